"""The package's rooms and the direction of their imports, read from the source (ast, tokenize; nothing is run).

Each module belongs to one room; a module may import its own room and the rooms below it, never one above, so the
rooms cannot form a circle. Lowest first:

- utils: the tensor-parallel group, the step context, devices, the weight loader, the tokenizer;
- params: the public value types (SamplingParams, outputs);
- config: the engine options, checked;
- quantization: FP8 weights and the FP8 KV cache's format, scales and kernels;
- attention: the paged KV cache and the backends that write and read it;
- layers: the model layers (linear, norms, activation, rotary, fused MoE);
- sampling: from logits to tokens (filters, penalties, bad words, the Gumbel-max draw);
- models: the model families, built from layers;
- engine: scheduling, the KV blocks, the model runner, the step loop;
- api: LLM, the package's face;
- data_parallel: replicas of LLM;
- batch: run-batch's work: its files, requests, flags, start-up and run;
- cli: the command line above it, and the checkpoint writer tool (which lives in utils/ for its
  `python -m nanovllm.utils.random_checkpoint` path).

Every import is an arrow: at module level, under `if TYPE_CHECKING:` and inside a function alike (a circle
through any of them is still a circle to a reader, and one refactor away from an import error). Beyond the rooms'
order, no modules form a circle at all, within a room too.
"""
import ast
import io
import tokenize
from pathlib import Path

import torch

PACKAGE = Path(__file__).resolve().parent.parent / "nanovllm"
ROOMS: list[tuple[str, tuple[str, ...]]] = [
    ("utils", ("nanovllm.utils",)),
    ("params", ("nanovllm.sampling_params", "nanovllm.outputs")),
    ("config", ("nanovllm.config",)),
    ("quantization", ("nanovllm.quantization",)),
    ("attention", ("nanovllm.attention",)),
    ("layers", ("nanovllm.layers",)),
    ("sampling", ("nanovllm.sampling",)),
    ("models", ("nanovllm.models",)),
    ("engine", ("nanovllm.engine",)),
    ("api", ("nanovllm", "nanovllm.llm")),
    ("data_parallel", ("nanovllm.data_parallel",)),
    ("batch", ("nanovllm.batch",)),
    ("cli", ("nanovllm.cli", "nanovllm.__main__", "nanovllm.utils.random_checkpoint",
             "nanovllm.utils.random_tokenizer", "nanovllm.utils.quantized_checkpoint")),
]
FP8_PREFIXES = ("fp8_", "kv_quant", "kv_scales")
SAMPLING_MODULES = ("sampler", "gumbel_max", "floors", "sampling_floors", "penalties", "bad_words")
MAX_LINES = 300
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def room_of(module: str) -> int:
    """The index of the room whose longest prefix names the module."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(ROOMS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} is in no room: add it to ROOMS"
    return best


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The nanovllm modules `module` imports, anywhere in it: ast.walk visits function bodies and `if
    TYPE_CHECKING:` blocks as well, so those imports count too."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import submodule` imports the submodule
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {name for name in found if name == "nanovllm" or name.startswith("nanovllm.")}


def arrows() -> list[tuple[str, str]]:
    """(importer, imported) for every import between two nanovllm modules."""
    known = modules()
    return [(module, target) for module, path in known.items() for target in sorted(imports(module, path, known))]


def upward(edges: list[tuple[str, str]]) -> list[str]:
    return [f"{a} ({ROOMS[room_of(a)][0]}) -> {b} ({ROOMS[room_of(b)][0]})"
            for a, b in edges if room_of(b) > room_of(a)]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node, or a node with an arrow to itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def room_cycles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """Groups of more than one room that import each other, round a circle."""
    graph: dict[str, set[str]] = {name: set() for name, _ in ROOMS}
    for a, b in edges:
        if room_of(a) != room_of(b):
            graph[ROOMS[room_of(a)][0]].add(ROOMS[room_of(b)][0])
    return circles(graph)


def module_cycles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """Groups of modules that import each other, round a circle (a package importing itself does not count: its
    __init__ naming its own submodules is how `from nanovllm.x import y` works)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
    return circles(graph)


def test_every_module_is_in_a_room():
    found = modules()
    assert "nanovllm.engine.llm_engine" in found  # the source tree itself, not an installed copy or nothing
    for module in found:
        room_of(module)


def test_no_import_runs_up_a_room():
    assert upward(arrows()) == []


def test_rooms_form_no_circle():
    assert room_cycles(arrows()) == []


def test_modules_form_no_circle():
    assert module_cycles(arrows()) == []


def test_an_import_in_a_function_or_for_type_checking_is_an_arrow(tmp_path):
    """The two kinds of import a reader skims past are read like any other."""
    path = tmp_path / "a.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nanovllm import b\n"
                    "def f():\n    from nanovllm.c import x\n")
    known = {"nanovllm.b": path, "nanovllm.c": path}
    assert imports("nanovllm.a", path, known) == {"nanovllm.b", "nanovllm.c"}
    assert module_cycles([("nanovllm.a", "nanovllm.b"), ("nanovllm.b", "nanovllm.a")]) == [["nanovllm.a",
                                                                                           "nanovllm.b"]]


def test_fp8_and_kv_cache_quantization_live_in_quantization():
    stray = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
             if p.name.startswith(FP8_PREFIXES) and p.parent.name != "quantization"]
    assert stray == []


def test_sampling_lives_in_sampling():
    stray = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
             if p.stem in SAMPLING_MODULES and p.parent.name != "sampling"]
    assert stray == []


def test_no_module_is_over_the_line_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _numbers_and_names(path: Path) -> tuple[list[float], list[str]]:
    """Numeric literals and names in code (not comments or strings)."""
    numbers, names = [], []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.NUMBER:
            try:
                numbers.append(float(token.string.replace("_", "")))
            except ValueError:  # hex, complex: not the maximum
                continue
        elif token.type == tokenize.NAME:
            names.append(token.string)
    return numbers, names


def _finfo_of_fp8(path: Path) -> int:
    """Calls of finfo on an FP8 dtype: the maximum asked of torch rather than read from its one place."""
    return sum(isinstance(node, ast.Call) and ast.unparse(node.func).endswith("finfo")
               and any(s in ast.unparse(node).lower() for s in ("float8", "fp8"))
               for node in ast.walk(ast.parse(path.read_text())))


def test_the_e4m3_format_is_written_once():
    """Its maximum as a number and the dtype by name each appear once in code; no finfo asks torch again."""
    maxima, dtypes, finfo = [], [], []
    for path in PACKAGE.rglob("*.py"):
        numbers, names = _numbers_and_names(path)
        where = str(path.relative_to(PACKAGE.parent))
        maxima += [where] * numbers.count(E4M3_MAX)
        dtypes += [where] * names.count("float8_e4m3fn")
        finfo += [where] * _finfo_of_fp8(path)
    assert len(maxima) == 1, f"448 written in {maxima}"
    assert len(dtypes) == 1, f"float8_e4m3fn named in {dtypes}"
    assert finfo == []
