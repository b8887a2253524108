"""An engine's options checked once, before any process or memory is taken: Config checks the options and reads
the checkpoint's config; the model code says whether it can build that model, and quantization whether it can
load the checkpoint's weights as stored."""
from nanovllm.config import Config
from nanovllm.models import model_class
from nanovllm.models.checks import check_model_config
from nanovllm.quantization import quantization_settings


def checked_config(model: str, **options) -> Config:
    config = Config.from_options(model, **options)
    model_class(config.hf_config)  # an unsupported architecture is refused before its sizes are looked at
    check_model_config(config.hf_config)
    quantization_settings(config.quantization, config.hf_config)
    return config
