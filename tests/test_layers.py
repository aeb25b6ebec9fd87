"""The layers in the folder names hold: dependencies point one way (workloads -> cluster -> replica -> scissorhands;
bench and dashboards may use them all), every Python folder has a rank (or is the test suite), only cluster/ imports Ray (the replica's metrics recorder reaches it lazily), nothing imports
a module of ours inside a function, and the modules import each other without a cycle. Read from the source: no
module is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A folder may import the folders of its own rank or below.
RANK = {"scissorhands": 0, "replica": 1, "cluster": 2, "workloads": 3, "bench": 4, "dashboards": 4}
OURS = set(RANK)
#: Python folders that are no layer: the test suite imports every layer.
NOT_LAYERS = {"tests"}
#: Ray is reached through cluster/ only; the replica's metrics recorder is a lazy adapter to Ray (imported when a
#: replica records into a running Ray), and bench/ tools may check what a machine has.
RAY_ALLOWED = {"cluster": "anywhere", "bench": "anywhere", "replica": "in a function"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder in RANK:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, module: str, *, type_checking: bool = True) -> list[tuple[str, bool, int]]:
    """(imported module, at module level, line) for every import in the file; relative imports resolved.
    ``type_checking=False`` leaves out the imports under ``if TYPE_CHECKING:`` (they never run)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = {id(n) for n in tree.body} | {
        id(c) for n in tree.body if isinstance(n, (ast.If, ast.Try)) for c in ast.walk(n)
    }
    typing_only = {
        id(c)
        for n in tree.body
        if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
        for c in ast.walk(n)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [f"{base}.{a.name}" for a in node.names] if base.split(".")[0] in OURS else [base]
        else:
            continue
        if type_checking or id(node) not in typing_only:
            out += [(name, id(node) in top, node.lineno) for name in names]
    return out


MODULES = _modules()


def unranked_python_folders(root: Path) -> set[str]:
    """Top-level folders of `root` (hidden ones aside: virtualenvs, caches) holding a Python file at any depth that
    neither RANK nor NOT_LAYERS names: their imports would go unchecked."""
    folders = {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and any(d.rglob("*.py"))}
    return folders - set(RANK) - NOT_LAYERS


def _resolve(name: str) -> str | None:
    """Our module that `name` (a module, or a module's attribute) names, or None when not ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers_and_never_inside_a_function(module):
    layer = module.split(".")[0]
    for name, at_top, line in _imports(MODULES[module], module):
        root = name.split(".")[0]
        where = f"{MODULES[module].relative_to(ROOT)}:{line} imports {name}"
        if root in RANK:
            assert RANK[root] <= RANK[layer], f"{where}: {root} is above {layer}"
            assert at_top, f"{where} inside a function: import it at the top of the module"
        if root == "ray":
            allowed = RAY_ALLOWED.get(layer)
            assert allowed is not None, f"{where}: only cluster/ imports Ray"
            assert allowed == "anywhere" or not at_top, f"{where}: {layer}/ never imports Ray when it is imported"


def test_no_module_imports_another_in_a_cycle():
    graph = {
        m: {r for n, at_top, _ in _imports(p, m, type_checking=False) if at_top and (r := _resolve(n)) and r != m}
        for m, p in MODULES.items()
    }
    # a package's __init__ importing its own submodules is how it re-exports them, not a cycle
    graph = {m: {r for r in deps if not r.startswith(m + ".")} for m, deps in graph.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
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
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_layer_rules_are_read_from_every_folder():
    assert {m.split(".")[0] for m in MODULES} == set(RANK)
    assert len(MODULES) > 60
    assert unranked_python_folders(ROOT) == set(), "give each Python folder a rank in RANK (tests/test_layers.py)"


def test_a_python_folder_without_a_rank_is_reported(tmp_path):
    for name in ("scissorhands", "tests", "docs", ".venv", "newlayer"):
        (tmp_path / name).mkdir()
    (tmp_path / "scissorhands" / "cache.py").write_text("")
    (tmp_path / "tests" / "test_x.py").write_text("")
    (tmp_path / ".venv" / "site.py").write_text("")
    (tmp_path / "docs" / "page.md").write_text("")
    assert unranked_python_folders(tmp_path) == set()  # an empty folder is not a Python folder
    (tmp_path / "newlayer" / "deep").mkdir()
    (tmp_path / "newlayer" / "deep" / "mod.py").write_text("")
    assert unranked_python_folders(tmp_path) == {"newlayer"}
