"""The layout shows the architecture: one package, `stagemesh`, holding four services (rooms: subpackages) that
find each other through the registry and talk through protos, and shared modules that import none of them. Read
from the source with `ast`, so imports inside functions count too."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = "stagemesh"
SERVICES = tuple(f"{SHARED}.{room}" for room in ("router", "stage_server", "scheduler", "registry"))
GENERATED = "stagemesh.v1"
COMPOSITION_ROOTS = ("stagemesh.cli", "stagemesh.launcher")
"""They start the services, so they alone in the shared package may import them."""
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / SHARED).rglob("*.py")):
        name = _module_name(path)
        if not name.startswith(GENERATED):
            found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code, resolved to modules where it can be."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in MODULES else node.module)
    return names


def _internal_edges(name: str) -> set[str]:
    """The package modules importing `name` runs: what it imports and, for each, its parent packages."""
    edges = set()
    for target in _imports(MODULES[name]):
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in MODULES and prefix != name:
                edges.add(prefix)
    return edges


def _room(module: str) -> str:
    """A service's package (stagemesh.router, ...), the shared package for the rest of stagemesh, else the top
    folder (tests, scripts)."""
    parts = module.split(".")
    if parts[0] == SHARED:
        return f"{SHARED}.{parts[1]}" if len(parts) > 1 and f"{SHARED}.{parts[1]}" in SERVICES else SHARED
    return parts[0]


def test_services_import_no_other_service():
    crossings = [
        f"{name} imports {target}"
        for name in MODULES
        if _room(name) in SERVICES
        for target in _imports(MODULES[name])
        if _room(target) in SERVICES and _room(target) != _room(name)
    ]
    assert not crossings, "services find each other through stagemesh.discovery, not each other's code:\n" + \
        "\n".join(crossings)


def test_shared_package_imports_no_service_scripts_or_tests():
    crossings = [
        f"{name} imports {target}"
        for name in MODULES
        if _room(name) == SHARED and name not in COMPOSITION_ROOTS
        for target in _imports(MODULES[name])
        if _room(target) in (*SERVICES, "scripts", "tests")
    ]
    assert not crossings, "\n".join(crossings)


def test_no_package_edits_sys_path():
    offenders = [
        str(path.relative_to(ROOT))
        for path in MODULES.values()
        if any(isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
               and n.value.id == "sys" for n in ast.walk(ast.parse(path.read_text())))
    ]
    assert not offenders, f"sys.path edited in {offenders}: import what is installed"


def test_no_import_cycles():
    """Tarjan's strongly connected components over the package modules' imports."""
    graph = {name: _internal_edges(name) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
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
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_sees_a_cycle_inside_a_function(tmp_path, monkeypatch):
    """The check above could pass by seeing nothing: show it sees an import hidden in a function."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import b\n")
    b.write_text("def f():\n    import a\n")
    monkeypatch.setitem(MODULES, "a", a)
    monkeypatch.setitem(MODULES, "b", b)
    assert _internal_edges("a") == {"b"} and _internal_edges("b") == {"a"}


def test_no_package_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern: {long}"


def test_the_architecture_pages_layout_table_matches_the_tree():
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w/]+)/` \|(.*)$", table, re.MULTILINE)
    listed = {f"{folder}/{file}" for folder, text in rows for file in re.findall(r"`([\w.-]+\.py)`", text)}
    folders = {str(p.parent.relative_to(ROOT)) for p in MODULES.values()}
    assert {folder for folder, _ in rows} >= folders, f"folders without a row: {folders - {f for f, _ in rows}}"
    missing = sorted(str(p.relative_to(ROOT)) for p in MODULES.values()
                     if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in listed)
    stale = sorted(f for f in listed if not (ROOT / f).exists())
    assert not missing, f"modules the layout table does not name: {missing}"
    assert not stale, f"the layout table names files that do not exist: {stale}"
    assert listed  # the table was found and read


def test_only_the_stage_imports_torch_and_transformers():
    """The `stagemesh` command, the scheduler, the registry and `stagemesh up`'s supervisor never pay the stage's
    torch and transformers imports (~4 s of a process's start on 2 cores); nor do the router's modules (its
    tokenizer, loaded through transformers at start, still does)."""
    probe = ("import sys, stagemesh.cli, stagemesh.router.server, stagemesh.scheduler.server, "
             "stagemesh.registry.service, stagemesh.launcher; "
             "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
