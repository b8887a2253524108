"""The KV cache's size: the blocks that fit in what gpu_memory_utilization leaves (a quarter of free memory on CPU)."""
import torch

from nanovllm.config import Config
from nanovllm.utils.device import available_cpu_memory


def blocks_that_fit(config: Config, use_cuda: bool, block_bytes: int) -> int:
    """How many KV blocks the memory left after the model and the warmup's activation peak holds."""
    if use_cuda:
        free, total = torch.cuda.mem_get_info()
        used = total - free
        stats = torch.cuda.memory_stats()
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        budget = int(total * config.gpu_memory_utilization) - used - peak + current
        where = (f"GPU total {total / 2**30:.2f} GiB x gpu_memory_utilization {config.gpu_memory_utilization}"
                 f" - used {used / 2**30:.2f} GiB - activation peak {(peak - current) / 2**30:.2f} GiB")
    else:
        available = available_cpu_memory()
        budget = int(available * config.gpu_memory_utilization) // 4
        where = f"a quarter of available CPU memory {available / 2**30:.2f} GiB x {config.gpu_memory_utilization}"
        # more blocks than every sequence at max_model_len could use would only cost memory
        max_useful = config.max_num_seqs * -(-config.max_model_len // config.kvcache_block_size)
        budget = min(budget, max_useful * block_bytes)
    num_blocks = budget // block_bytes
    if num_blocks <= 0:
        raise RuntimeError(f"KV cache budget of {budget / 2**20:.1f} MiB ({where}) holds no block of "
                           f"{block_bytes / 2**20:.1f} MiB; raise gpu_memory_utilization or lower "
                           f"kvcache_block_size/max_num_batched_tokens")
    return num_blocks
