"""common/ is a package of small modules without import cycles: each module's imports of
common modules (at the top or inside functions) form a graph with no cycle."""

import ast

from conftest import REPO


def common_imports() -> dict[str, set[str]]:
    """{module: the common modules it imports, anywhere in its file}."""
    modules = {p.stem: p for p in (REPO / "common").glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "common":
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("common.")}
        graph[name] = found & set(modules)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search, as [a, b, ..., a]."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_common_has_no_import_cycle():
    graph = common_imports()
    assert {"checks", "launch", "checkpoint"} <= set(graph)  # the scan sees the package
    assert cycles(graph) == []


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
