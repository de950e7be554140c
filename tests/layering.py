"""The package's import graph, read from the source (imports inside functions count)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    files = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
             for p in SRC.rglob("*.py")}
    graph = {m: set() for m in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    target = next((c for c in (f"{base}.{alias.name}", base) if c in files),
                                  None)
                    if target and target != module:
                        graph[module].add(target)
            elif isinstance(node, ast.Import):
                graph[module] |= {a.name for a in node.names
                                  if a.name in files and a.name != module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the graph's strongly connected components."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out
