"""An engine's options checked once, before any process or memory is taken: Config checks the options and reads
the checkpoint's config; the model code says whether it can build that model, and quantization whether it can
load the checkpoint's weights as stored."""
import logging

from nanovllm.config import Config
from nanovllm.models import model_class
from nanovllm.models.checks import check_model_config
from nanovllm.quantization import quantization_settings

logger = logging.getLogger(__name__)


def checked_config(model: str, **options) -> Config:
    config = Config.from_options(model, **options)
    model_class(config.hf_config)  # an unsupported architecture is refused before its sizes are looked at
    check_model_config(config.hf_config)
    quantization_settings(config.quantization, config.hf_config)
    if config.attention_backend == "flashinfer" and config.kv_cache_dtype != "auto":
        logger.warning("attention_backend='flashinfer' with kv_cache_dtype=%r: XQA's FP8 decode also rounds the query "
                       "and the softmax probabilities to e4m3, so it is less exact than the FP8 cache alone (the "
                       "triton backend keeps both in 16 bits; docs/flashinfer.md)", config.kv_cache_dtype)
    return config
