"""Layers that only point down, for modules and for folders.

Every `import`/`from ... import` of a litkv module, anywhere in a file (module level, `TYPE_CHECKING`
blocks and function bodies alike), is an edge. Module level: the graph has no circle. Folder level: a
package's own modules and each of its subpackages are folders (`litkv/*.py` is the folder `root`,
`litkv/kvcache/` is `kvcache`, ...; `litkv/__init__.py`, the package's face that only re-exports, is
the folder `face`); `LAYERS` declares their order bottom up, and no import runs from a folder to one
above it (so no two folders import each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "litkv"

# The folders bottom up: a folder may import its own layer and those below it, never one above.
LAYERS = (
    "core",  # validation, rope: imports nothing of litkv
    "learned",  # eviction gates and their soft attention: tensors the caches and the model read
    "kvcache",  # the cache contract, policies, storage formats and their kernels
    "root",  # model, attention, runner, state, generate, evaluate, checkpoint, runtime, the commands' table
    "gradient",  # gradients through the cache
    "finetune",  # LoRA / full fine-tuning and the gate training
    "serve",  # the OpenAI-compatible server
    "cli",  # the command functions
    "face",  # litkv/__init__.py: public re-exports
)


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
    """The folder a module belongs to: `face` for `litkv` itself, a subpackage's name, or `root`."""
    parts = module.split(".")
    if len(parts) == 1:
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


def imports_up(edges: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """The module imports that run from a folder to one above it in `layers`."""
    rank = {name: i for i, name in enumerate(layers)}
    return [
        f"{a} -> {b}: {how}"
        for a, targets in folder_graph(edges).items()
        for b, hows in targets.items()
        if rank[a] < rank[b]
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
    assert "litkv.model" in edges["litkv.runner"]  # a TYPE_CHECKING import is seen
    assert "litkv.kvcache" in edges["litkv"]  # `from litkv.kvcache import KVCache`: the subpackage's face


def test_folders_are_the_subpackages_the_root_and_the_face() -> None:
    assert folder_of("litkv") == "face"
    assert folder_of("litkv.model") == "root"
    assert folder_of("litkv.kvcache") == folder_of("litkv.kvcache.h2o") == "kvcache"
    on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} | {"root", "face"}
    assert on_disk == set(LAYERS), f"declare every folder in LAYERS: on disk {sorted(on_disk)}, LAYERS {LAYERS}"


def test_imports_up_names_an_import_against_the_order() -> None:
    edges = {"litkv.model": {"litkv.cli.common"}, "litkv.cli.common": {"litkv.model"}}
    assert imports_up(edges, LAYERS) == ["root -> cli: litkv.model -> litkv.cli.common"]
    assert imports_up({"litkv.cli.common": {"litkv.model"}}, LAYERS) == []


def test_litkv_has_no_import_circle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_folder_imports_a_folder_that_imports_it() -> None:
    folders = {a: set(targets) for a, targets in folder_graph(graph()).items()}
    cycle = find_cycle(folders)
    assert cycle is None, "folder circle: " + " -> ".join(cycle or [])


def test_no_import_runs_up_the_layers() -> None:
    up = imports_up(graph(), LAYERS)
    assert not up, f"{len(up)} imports run up the layers {LAYERS}:\n" + "\n".join(up)
