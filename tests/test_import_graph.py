"""No import circle in `litkv`: every `import`/`from ... import` of a litkv module, anywhere in a file
(module level, `TYPE_CHECKING` blocks and function bodies alike), is an edge; the graph must be acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "litkv"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The litkv modules `path` imports (a `from pkg import name` naming a submodule counts as that module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.split(".")[0] == "litkv")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "litkv":
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            out.update(subs or {node.module})
    return {m for m in out if m in modules}


def graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    names = set(files)
    edges = {name: _imports(path, names) - {name} for name, path in files.items()}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
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


def test_graph_reads_type_checking_imports() -> None:
    edges = graph()
    assert "litkv.kvcache.base" in edges["litkv.kvcache.registry"]  # a module-level import is seen
    assert "litkv.model" in edges["litkv.runner"]  # a TYPE_CHECKING import is seen


def test_litkv_has_no_import_circle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])
