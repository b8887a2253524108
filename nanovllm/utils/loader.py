import os
from glob import glob

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of the checkpoint's safetensors files into the model, mapping packed names.

    The loader only maps names; each parameter's weight_loader knows which slice its rank keeps.
    """
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                for checkpoint_name, (packed_name, shard_id) in packed.items():
                    if checkpoint_name in name:
                        target = name.replace(checkpoint_name, packed_name)
                        param = params[target]
                        param.weight_loader(param, f.get_tensor(name), shard_id)
                        break
                else:
                    target = name
                    if target not in params:
                        if target == "lm_head.weight":
                            continue  # tied to the embedding, which is loaded under its own name
                        raise KeyError(f"checkpoint tensor {name!r} matches no model parameter")
                    param = params[target]
                    getattr(param, "weight_loader", default_weight_loader)(param, f.get_tensor(name))
                loaded.add(target)
    missing = set(params) - loaded
    if "lm_head.weight" in missing and params["lm_head.weight"] is params.get("model.embed_tokens.weight"):
        missing.discard("lm_head.weight")
    if missing:
        raise KeyError(f"checkpoint {path} lacks weights for {sorted(missing)}")
