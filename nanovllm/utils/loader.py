import json
import os
from collections.abc import Callable, Sequence
from glob import glob

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
ShardId = str | int | None  # which part of a packed parameter a checkpoint tensor fills; None: the whole of it


def check_shape(loaded: torch.Tensor, expected: Sequence[int], meaning: str = "") -> None:
    """Refuse a checkpoint tensor whose full (unsharded) shape is not `expected`.

    copy_ would broadcast a [1] norm weight over [128], and row slicing would truncate or zero-pad an embedding, so
    a wrong checkpoint would load and generate garbage. The loader adds the tensor's name to the message."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"expected shape {list(expected)}{meaning}, found {list(loaded.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[nn.Parameter, ShardId]]:
    """Every tensor name the checkpoint must hold -> the parameter (and part of it) the tensor fills.

    Packed parameters expand into one name per part (qkv_proj -> q_proj, k_proj, v_proj), so a part that is missing
    is named as the checkpoint names it; a parameter stacking many tensors (a MoE layer's experts) lists its own
    parts in `checkpoint_names`, relative to its module. Aliases of a parameter (tied lm_head) are not listed."""
    parts: dict[str, list[tuple[str, ShardId]]] = {}
    for checkpoint_name, (packed_name, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        parts.setdefault(packed_name, []).append((checkpoint_name, shard_id))
    targets: dict[str, tuple[nn.Parameter, ShardId]] = {}
    for name, param in model.named_parameters():
        own_parts = getattr(param, "checkpoint_names", None)
        if own_parts is not None:
            module = name.rpartition(".")[0]
            targets.update({f"{module}.{part}": (param, shard_id) for part, shard_id in own_parts})
            continue
        atoms = name.split(".")
        i = next((i for i, atom in enumerate(atoms) if atom in parts), None)
        if i is None:
            targets[name] = (param, None)
            continue
        for checkpoint_name, shard_id in parts[atoms[i]]:
            targets[".".join([*atoms[:i], checkpoint_name, *atoms[i + 1:]])] = (param, shard_id)
    return targets


def _open(file: str):
    # safetensors' errors ("incomplete metadata, file not fully covered") do not say which file
    try:
        return safe_open(file, "pt", "cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read checkpoint file {file}: {e}") from e


def _read_index(path: str, index_path: str) -> dict[str, str]:
    """The index's weight_map as tensor name -> shard path; every shard it names must exist."""
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the shard index {index_path}: {type(e).__name__}: {e}") from e
    shards = {shard: os.path.join(path, shard) for shard in set(weight_map.values())}
    absent = sorted(file for file in shards.values() if not os.path.isfile(file))
    if absent:
        raise FileNotFoundError(f"checkpoint shard(s) {absent} named by {index_path} do not exist")
    return {name: shards[shard] for name, shard in weight_map.items()}


def locate_tensors(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, from the files' headers (no tensor data is read).

    With model.safetensors.index.json only the shards it names are read (repositories may also ship a consolidated
    copy beside them) and each tensor must be in the shard it names; without one every *.safetensors file is read.
    A tensor found in two files is an error: which copy is right cannot be told."""
    index_path = os.path.join(path, INDEX_FILE)
    indexed = _read_index(path, index_path) if os.path.exists(index_path) else None
    files = sorted(set(indexed.values())) if indexed is not None else sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}" if indexed is None else
                                f"{index_path} names no shards")
    sources: dict[str, str] = {}
    for file in files:
        with _open(file) as f:
            names = list(f.keys())
        for name in names:
            if name in sources:
                raise ValueError(f"checkpoint tensor {name!r} appears twice: in {sources[name]} and in {file}")
            if indexed is not None and indexed.get(name) != file:
                where = f"names {indexed[name]} for it" if name in indexed else "does not list it"
                raise ValueError(f"checkpoint tensor {name!r} is in {file}, but {index_path} {where}")
            sources[name] = file
    if indexed is not None:
        absent = sorted(name for name in indexed if name not in sources)
        if absent:
            raise ValueError(f"{index_path} lists tensor(s) {_some(absent)} in shards that do not hold them: "
                             f"{sorted({indexed[name] for name in absent})}")
    return sources


def _some(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_model(model: nn.Module, path: str,
               extra: Callable[[str], bool] = lambda name: False) -> dict[str, torch.Tensor]:
    """Fill every parameter of the model from the checkpoint at `path`, each part of a packed one exactly once;
    return, by name, the tensors no parameter takes that `extra` accepts (an FP8 KV cache's scales).

    The loader only maps names; each parameter's weight_loader knows which slice its rank keeps and checks the full
    tensor's shape. Names are checked against the files' headers before any tensor is read, so a missing, extra or
    duplicated tensor fails fast, even in a checkpoint of many gigabytes."""
    targets = checkpoint_targets(model)
    # a tied lm_head is the embedding under another name: its checkpoint copy, if any, is not used
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - \
        {name for name, _ in model.named_parameters()}
    sources = locate_tensors(path)
    extras = {name: file for name, file in sources.items() if name not in targets and extra(name)}
    unknown = sorted(name for name in sources if name not in targets and name not in aliases and name not in extras)
    if unknown:
        raise ValueError(f"checkpoint tensor(s) {_some(unknown)} in {path} match no model parameter")
    missing = sorted(name for name in targets if name not in sources)
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensor(s) {_some(missing)}")
    by_file: dict[str, list[str]] = {}
    for name, file in sources.items():
        if name in targets:
            by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                param, shard_id = targets[name]
                try:
                    loaded = f.get_tensor(name)
                except SafetensorError as e:
                    raise ValueError(f"cannot read tensor {name!r} from {file}: {e}") from e
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, loaded) if shard_id is None else loader(param, loaded, shard_id)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r} in {file}: {e}") from e
    found = {}
    for name, file in extras.items():
        with _open(file) as f:
            found[name] = f.get_tensor(name)
    return found
