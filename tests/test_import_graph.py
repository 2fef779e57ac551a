"""Layers that only point down, for modules and for folders.

Every `import`/`from ... import` of a litkv module, anywhere in a file (module level, `TYPE_CHECKING`
blocks and function bodies alike), is an edge. Module level: the graph has no circle. Folder level: each
subpackage of litkv is a folder (`litkv/kvcache/` is `kvcache`, ...); `litkv/__init__.py` (the package's
face, which only re-exports) and `litkv/__main__.py` (the command table) are the folder `face`; no other
module may sit in the package root. `FLOORS` declares the folders' order bottom up: a folder may import
folders on floors below its own, never one on its own floor or above (so no two folders import each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "litkv"

# The floors bottom up: a folder imports only folders on floors below its own.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("core",),  # validation, rope, atomic files, tokenizer helpers: imports nothing of litkv
    ("gates",),  # eviction gates and their soft attention: tensors the caches and the model read
    ("kvcache",),  # the cache contract, policies, storage formats and their kernels (kvcache/kernels/: Triton)
    ("modeling",),  # config, the GPT, attention, Mamba-2, the chunked runner, fingerprints, quantised weights
    ("states", "checkpoints", "gradient"),  # cache state values/files/stores; checkpoint I/O; gradients
    ("inference",),  # generate, KV blocks, the conversation engine, chat templates
    ("eval", "serve", "hf"),  # evaluation tasks and benchmarks; the OpenAI-compatible server; litkv.hf
    ("finetune",),  # the training library: loop, data, LoRA, sharding, eviction-gate training
    ("cli",),  # the command functions (`litkv finetune` included)
    ("face",),  # litkv/__init__.py (public re-exports) and litkv/__main__.py (the command table)
)
LAYERS = tuple(folder for floor in FLOORS for folder in floor)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The litkv modules `path` imports: `from pkg import name` counts as `pkg.name` where that is a module,
    and as `pkg` for every other name (a class or function taken from the package's face)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.split(".")[0] == "litkv")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "litkv":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
    return {m for m in out if m in modules}


def graph() -> dict[str, set[str]]:
    """Module -> the litkv modules it imports."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    names = set(files)
    return {name: _imports(path, names) - {name} for name, path in files.items()}


def folder_of(module: str) -> str:
    """The folder a module belongs to: `face` for `litkv` and `litkv.__main__`, else its subpackage's name
    (`root` for any other module in the package root, which `test_the_root_holds_only_the_face` refuses)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "face"
    return parts[1] if (PACKAGE / parts[1]).is_dir() else "root"


def folder_graph(edges: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Folder -> folder it imports -> the module imports (`"a -> b"`) that make that edge."""
    out: dict[str, dict[str, list[str]]] = {}
    for source, targets in edges.items():
        for target in sorted(targets):
            a, b = folder_of(source), folder_of(target)
            if a != b:
                out.setdefault(a, {}).setdefault(b, []).append(f"{source} -> {target}")
    return out


def imports_up(edges: dict[str, set[str]], floors: tuple[tuple[str, ...], ...]) -> list[str]:
    """The module imports that run from a folder to one on its own floor or above in `floors`."""
    rank = {name: i for i, floor in enumerate(floors) for name in floor}
    return [
        f"{a} -> {b}: {how}"
        for a, targets in folder_graph(edges).items()
        for b, hows in targets.items()
        if rank[a] <= rank[b]
        for how in hows
    ]


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_graph_reads_type_checking_and_face_imports() -> None:
    edges = graph()
    assert "litkv.kvcache.base" in edges["litkv.kvcache.registry"]  # a module-level import is seen
    assert "litkv.modeling.model" in edges["litkv.modeling.runner"]  # a TYPE_CHECKING import is seen
    assert "litkv.kvcache" in edges["litkv"]  # `from litkv.kvcache import KVCache`: the subpackage's face


def test_folders_are_the_subpackages_and_the_face() -> None:
    assert folder_of("litkv") == folder_of("litkv.__main__") == "face"
    assert folder_of("litkv.modeling.model") == "modeling"
    assert folder_of("litkv.kvcache") == folder_of("litkv.kvcache.h2o") == "kvcache"
    on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} | {"face"}
    assert on_disk == set(LAYERS), f"declare every folder in FLOORS: on disk {sorted(on_disk)}, FLOORS {FLOORS}"


def test_the_root_holds_only_the_face() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules in the package root (move each into the folder of its job): {loose}"


def test_imports_up_names_an_import_against_the_order() -> None:
    edges = {"litkv.modeling.model": {"litkv.cli.common"}, "litkv.cli.common": {"litkv.modeling.model"}}
    assert imports_up(edges, FLOORS) == ["modeling -> cli: litkv.modeling.model -> litkv.cli.common"]
    assert imports_up({"litkv.cli.common": {"litkv.modeling.model"}}, FLOORS) == []
    # folders on one floor may not import each other
    same_floor = {"litkv.states.state": {"litkv.checkpoints.checkpoint"}}
    assert imports_up(same_floor, FLOORS) == [
        "states -> checkpoints: litkv.states.state -> litkv.checkpoints.checkpoint"
    ]


def test_litkv_has_no_import_circle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_folder_imports_a_folder_that_imports_it() -> None:
    folders = {a: set(targets) for a, targets in folder_graph(graph()).items()}
    cycle = find_cycle(folders)
    assert cycle is None, "folder circle: " + " -> ".join(cycle or [])


def test_no_import_runs_up_the_floors() -> None:
    up = imports_up(graph(), FLOORS)
    assert not up, f"{len(up)} imports run up the floors {FLOORS}:\n" + "\n".join(up)


def test_kernels_import_only_litkv_core() -> None:
    """`litkv/kvcache/kernels/` sits below the PyTorch paths that call it (plain tensors in and out): it imports
    nothing of litkv but `litkv.core` (the CPU kernel's cache directory and temporary names)."""
    edges = graph()
    kernels = {m: sorted(t) for m, t in edges.items() if m.startswith("litkv.kvcache.kernels")}
    assert {"litkv.kvcache.kernels.quant_decode", "litkv.kvcache.kernels.cpu_decode"} <= set(kernels)
    assert all(t.startswith("litkv.core.") for targets in kernels.values() for t in targets), kernels
