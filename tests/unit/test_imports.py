"""The package's import graph, read from the source: no cycle anywhere in `specdec` (counting imports made
only for type checking and those inside functions), and every import points down the layers."""

import ast
import re
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent
# Each layer may import the layers after it, never one before it.
LAYERS = ["serving", "gateway", "train", "triton", "engine", "decoding"]


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("specdec",) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The specdec modules `path` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from specdec.triton.admission import ticket_line`: that module, where the name is one
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def test_the_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    edges = graph()
    assert "specdec.triton.orchestrator" in edges and edges["specdec.triton.orchestrator"]  # the graph is read
    assert cycles(edges) == []


def test_imports_point_down_the_layers():
    def layer(name):
        parts = name.split(".")
        return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None

    upward = [(source, target) for source, targets in graph().items() for target in targets
              if layer(source) is not None and layer(target) is not None and layer(target) < layer(source)]
    assert upward == []


def test_every_package_is_installed_and_lists_its_modules():
    """pyproject.toml installs every package (a missing one imports in an editable install and fails in
    the image), and each package's docstring names each of its modules and subpackages."""
    import tomllib

    project = tomllib.loads((ROOT.parents[1] / "pyproject.toml").read_text())
    installed = set(project["tool"]["setuptools"]["packages"])
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert packages <= installed, sorted(packages - installed)
    unlisted = {}
    for package in packages:
        init = modules()[package]
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = set(re.findall(r"^\s+(\w+)/?\s", doc, re.M))
        members = {path.stem for path in init.parent.glob("*.py") if path.stem != "__init__"}
        members |= {path.parent.name for path in init.parent.glob("*/__init__.py")}
        if members - named:
            unlisted[package] = sorted(members - named)
    assert unlisted == {}


def test_the_launcher_and_the_gateway_start_without_torch():
    """Every server start runs the launcher (and the gateway beside it) before tritonserver: torch and
    transformers there cost about 3 s of every start (the model stubs import them for themselves)."""
    import subprocess
    import sys

    for module in ("specdec.serving.launcher", "specdec.gateway.app"):
        code = f"import sys, {module}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.strip() == "[]", (module, result.stdout, result.stderr[-2000:])
