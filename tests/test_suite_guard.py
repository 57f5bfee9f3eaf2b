"""A guard on the suite itself: every test asserts something, read from its source (ast), so that a test that
cannot fail is not added unnoticed. A test asserts where its body, or a helper of the tests package it calls
(followed call by call, across test modules: helpers it imports, methods of the tests' classes such as a
fixture's Mesh, callbacks it hands on, closures a fixture hands it; not a fixture's own setup), holds an
`assert`, `pytest.raises`, `pytest.fail` or `pytest.warns`, raises AssertionError, or calls a library's
assertion (a function whose name starts with `assert`: torch.testing.assert_close, ...).

The exceptions, each with why it needs no assertion of its own, are listed in NO_ASSERTION_NEEDED."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).parent

NO_ASSERTION_NEEDED: dict[str, str] = {
    "test_etcd_access.py::test_etcd3aio_and_the_otlp_exporter_load_in_either_order":
        "its check is the child interpreter's exit: subprocess.run(check=True) raises CalledProcessError where the "
        "imports or messages fail (-W error: a warning too)",
}
"""Tests ("file::name") that pass by running without an exception alone, and why that is the behaviour."""

ASSERTING_PYTEST = {"raises", "fail", "warns"}


@dataclass
class Module:
    name: str  # "conftest", "test_claims", ...
    tree: ast.Module
    functions: dict[str, ast.AST] = field(default_factory=dict)  # module-level functions, by name
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name) in tests
    modules: dict[str, str] = field(default_factory=dict)  # local name -> a module of tests


def _is_fixture(function: ast.AST | None) -> bool:
    """Whether the function is a pytest fixture (@pytest.fixture, with or without arguments)."""
    for decorator in getattr(function, "decorator_list", []):
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "fixture" or (
                isinstance(target, ast.Name) and target.id == "fixture"):
            return True
    return False


def _tests_module(module: str | None, level: int) -> str | None:
    """The module of the tests package an import names ("tests.conftest" or ".conftest" -> "conftest")."""
    if level == 1:
        return module or ""
    if module == "tests":
        return ""
    if module and module.startswith("tests."):
        return module.removeprefix("tests.")
    return None


def load_modules(folder: Path) -> dict[str, Module]:
    modules = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module = Module(path.stem, tree)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                module.functions[node.name] = node
        for node in ast.walk(tree):  # imports at the top or inside functions
            if isinstance(node, ast.ImportFrom):
                source = _tests_module(node.module, node.level)
                if source is None:
                    continue
                for alias in node.names:
                    if source == "":  # from tests import test_x
                        module.modules[alias.asname or alias.name] = alias.name
                    else:
                        module.imported[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    source = _tests_module(alias.name, 0)
                    if source and alias.asname:
                        module.modules[alias.asname] = source
        modules[module.name] = module
    return modules


class Suite:
    """The tests package's functions and methods, and which of them assert (themselves or through a callee)."""

    def __init__(self, folder: Path):
        self.modules = load_modules(folder)
        self.methods: dict[str, list[ast.AST]] = {}  # a method name -> the tests classes' methods of that name
        self.owner: dict[int, Module] = {}  # id(function node) -> its module
        for module in self.modules.values():
            for node in ast.walk(module.tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.owner[id(node)] = module
                elif isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self.methods.setdefault(item.name, []).append(item)
        self._memo: dict[int, bool] = {}

    def resolve(self, module: Module, name: str, seen: frozenset = frozenset()) -> ast.AST | None:
        """The function `name` means in module: its own, the one it imports from the tests package, or a fixture
        of conftest.py (which every test module sees without importing it)."""
        if name in module.functions:
            return module.functions[name]
        if name in module.imported and name not in seen:
            source, original = module.imported[name]
            if source in self.modules:
                return self.resolve(self.modules[source], original, seen | {name})
        conftest = self.modules.get("conftest")
        if conftest is not None and module is not conftest and _is_fixture(conftest.functions.get(name)):
            return conftest.functions[name]
        return None

    def callees(self, function: ast.AST) -> list[ast.AST]:
        """The tests package's functions that this one calls or hands on (a callback), and its nested ones."""
        module = self.owner[id(function)]
        found = []
        for node in ast.walk(function):
            if node is not function and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                found.append(node)  # a nested helper or a callback: what it asserts, the test asserts
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                target = self.resolve(module, node.id)
                if _is_fixture(target):  # the helpers it hands the test, not its own setup's checks
                    found.extend(n for n in ast.walk(target) if n is not target and isinstance(
                        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
                elif target is not None:
                    found.append(target)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                base = node.value
                if isinstance(base, ast.Name) and base.id in module.modules:  # test_x.helper
                    other = self.modules.get(module.modules[base.id])
                    if other is not None and node.attr in other.functions:
                        found.append(other.functions[node.attr])
                found.extend(self.methods.get(node.attr, []))  # obj.method: a tests class's method of that name
        return found

    def _asserts_itself(self, function: ast.AST) -> bool:
        module = self.owner.get(id(function))
        for node in ast.walk(function):
            if isinstance(node, ast.Assert):
                return True
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id == "AssertionError":
                    return True
            if isinstance(node, ast.Call):
                func = node.func
                if (isinstance(func, ast.Attribute) and func.attr in ASSERTING_PYTEST
                        and isinstance(func.value, ast.Name) and func.value.id == "pytest"):
                    return True
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                local = isinstance(func, ast.Name) and module is not None and self.resolve(module, name) is not None
                if name.startswith("assert") and not local and name not in self.methods:
                    return True  # a library's assertion (a helper of ours named assert_... is followed instead)
        return False

    def asserts(self, function: ast.AST) -> bool:
        """Whether the function, or anything of the tests package it calls, asserts (depth first, memoized)."""
        key = id(function)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = False  # a cycle asserts nothing by itself
        result = self._asserts_itself(function) or any(self.asserts(c) for c in self.callees(function)
                                                       if c is not function)
        self._memo[key] = result
        return result

    def tests(self) -> dict[str, ast.AST]:
        """Every test: "file::name" -> its function (module-level test_*, and test_* methods of Test* classes)."""
        found = {}
        for module in self.modules.values():
            if not module.name.startswith("test_"):
                continue
            for node in module.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                    found[f"{module.name}.py::{node.name}"] = node
                elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                            found[f"{module.name}.py::{node.name}::{item.name}"] = item
        return found


@functools.cache
def assertionless_tests(folder: Path) -> list[str]:
    suite = Suite(folder)
    return sorted(name for name, function in suite.tests().items() if not suite.asserts(function))


def test_every_test_asserts_something():
    missing = [name for name in assertionless_tests(TESTS) if name not in NO_ASSERTION_NEEDED]
    assert missing == [], ("these tests assert nothing (no assert, pytest.raises or pytest.fail, in them or in a "
                           "helper of tests/ they call): make them able to fail, or list them in "
                           f"NO_ASSERTION_NEEDED with the reason: {missing}")


def test_the_listed_exceptions_still_are_assertionless_tests():
    """An exception that now asserts, or is gone, leaves the list: it must not cover a later test of that name."""
    assert sorted(set(NO_ASSERTION_NEEDED) - set(assertionless_tests(TESTS))) == []


def test_the_guard_finds_a_test_that_asserts_nothing(tmp_path):
    """On a small package of its own: a test without assertion is found (one whose fixture's setup asserts too);
    one whose helper asserts, in its module, imported from another, called as a method, through a callback, a
    fixture's checking closure or a library's assertion, is not."""
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "def check(x):\n    assert x\n"
        "class Mesh:\n    def settled(self):\n        if not self:\n            raise AssertionError('no')\n"
        "def until(condition):\n    if not condition():\n        pytest.fail('never')\n"
        "@pytest.fixture\ndef mesh():\n    m = Mesh()\n    assert m is not None\n    return m\n"
        "@pytest.fixture\ndef checker():\n    def checked(x):\n        assert x\n    return checked\n")
    (tmp_path / "test_a.py").write_text(
        "import torch\n"
        "from tests.conftest import check, until\n"
        "def helper():\n    return 1\n"
        "def deeper():\n    check(helper())\n"
        "def test_nothing():\n    helper()\n"
        "async def test_nothing_but_a_fixture_that_asserts(mesh):\n    await mesh.start()\n"
        "def test_imported():\n    check(1)\n"
        "def test_transitive():\n    deeper()\n"
        "def test_method(mesh):\n    mesh.settled()\n"
        "def test_callback():\n    until(lambda: True)\n"
        "def test_fixture_closure(checker):\n    checker(1)\n"
        "def test_library():\n    torch.testing.assert_close(1, 1)\n"
        "def test_raises():\n    import pytest\n    with pytest.raises(ValueError):\n        int('x')\n"
        "class TestGrouped:\n    def test_plain(self):\n        helper()\n    def test_asserts(self):\n"
        "        assert helper() == 1\n")
    assert assertionless_tests(tmp_path) == [
        "test_a.py::TestGrouped::test_plain", "test_a.py::test_nothing",
        "test_a.py::test_nothing_but_a_fixture_that_asserts"]
