import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.context import get_context
from nanovllm.utils.loader import check_shape
from nanovllm.utils.parallel import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; ids outside a rank's rows contribute zeros to the all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_rank = (num_embeddings + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        # slicing rows would silently truncate a larger table or leave a smaller one's missing rows zero
        check_shape(loaded, (self.num_embeddings, self.embedding_dim),
                    f" (vocab_size={self.num_embeddings} by hidden_size={self.embedding_dim} from the model config)")
        rows = loaded[self.vocab_start:self.vocab_end]
        param.data.zero_()
        param.data[: rows.size(0)].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = F.embedding((input_ids - self.vocab_start) * in_shard, self.weight)
        y = y * in_shard.unsqueeze(1).to(y.dtype)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over a vocabulary split across ranks, gathered on rank 0.

    Prefill scores only each sequence's last token: the others are never sampled."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup) -> None:
        super().__init__(num_embeddings, embedding_dim, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        context = get_context()
        if context.is_prefill:
            x = x[context.cu_seqlens_q[1:] - 1].contiguous()
        logits = F.linear(x, self.weight)
        if self.tp_size == 1:
            return logits
        parts = self.tp.gather_to_first(logits)
        if parts is None:
            return None
        # the last rank's rows are padded when the vocabulary does not split evenly
        return torch.cat(parts, -1)[:, : self.num_embeddings]
