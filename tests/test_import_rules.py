"""The import rules of ARCHITECTURE.md, enforced: every module under rawserve/ is parsed, and each import
(at the top or inside a function) is checked against what its layer may import."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "rawserve"

# The seam between the frontend and the core: the only engine modules the frontend (and the API) may import.
# The grammar compilers are in it too: the API compiles a request's grammar (pure Python, no torch) and the
# core walks it over the vocabulary (guided/matcher.py and guided/vocab.py, which stay core-only).
SEAM = {"rawserve.engine.types", "rawserve.engine.messages", "rawserve.engine.ipc", "rawserve.engine.rules",
        "rawserve.engine.launch", "rawserve.engine.cpu_budget", "rawserve.engine.pooling",
        "rawserve.engine.mm_inputs", *(f"rawserve.engine.guided.{name}" for name in (
            "grammar", "nfa", "automaton", "regex", "json_schema", "json_compiler", "json_keywords", "json_strings",
            "json_numbers", "json_formats", "gbnf", "tool_calls"))}
STDLIB_ONLY = {"rawserve.config", "rawserve.errors", "rawserve.metrics", "rawserve.process_stats"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set[str]:
    """Every module name `path` imports, anywhere in it; `from a import b` counts as a and as a.b."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def is_core(module: str) -> bool:
    return is_under(module, "rawserve.engine") and not is_under(module, "rawserve.engine.frontend") \
        and module != "rawserve.engine"


def in_seam(module: str) -> bool:
    return any(is_under(module, seam) for seam in SEAM)


def violations(name: str, imported: set[str]) -> list[str]:
    """What module `name` may not import, among `imported`."""
    bad = []
    for target in sorted(imported):
        if is_under(name, "rawserve.http") and any(is_under(target, p) for p in (
                "rawserve.api", "rawserve.engine", "rawserve.text")):
            bad.append(target)
        elif is_under(name, "rawserve.text") and any(is_under(target, p) for p in (
                "rawserve.http", "rawserve.api", "rawserve.engine")):
            bad.append(target)
        elif is_core(name) and (is_under(target, "asyncio") or any(is_under(target, p) for p in (
                "rawserve.http", "rawserve.api", "rawserve.engine.frontend"))):
            bad.append(target)
        elif is_under(name, "rawserve.engine.frontend") and (
                is_under(target, "torch") or (is_core(target) and not in_seam(target))):
            bad.append(target)
        elif is_under(name, "rawserve.api") and is_core(target) and not in_seam(target):
            bad.append(target)
        elif name in STDLIB_ONLY and is_under(target, "rawserve"):
            bad.append(target)
        elif in_seam(name) and is_under(target, "torch"):  # the front process must load no torch
            bad.append(target)
    return bad


def test_every_module_keeps_its_layers_import_rules():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 40  # the walk found the package
    broken = {module_name(path): bad for path in modules if (bad := violations(module_name(path), imports_of(path)))}
    assert not broken, f"imports that break ARCHITECTURE.md's rules: {broken}"


@pytest.mark.parametrize("name, imported", [
    ("rawserve.http.connection", {"rawserve.api.serving"}),
    ("rawserve.text.stop", {"rawserve.engine.types"}),
    ("rawserve.engine.scheduler", {"asyncio"}),
    ("rawserve.engine.core_loop", {"rawserve.engine.frontend.async_llm"}),
    ("rawserve.engine.frontend.llm", {"rawserve.engine.core"}),
    ("rawserve.engine.frontend.async_llm", {"torch"}),
    ("rawserve.api.app", {"rawserve.engine.core"}),
    ("rawserve.api.app", {"rawserve.engine.core.make_engine_core"}),
    ("rawserve.metrics", {"rawserve.engine.types"}),
])
def test_a_forbidden_import_is_caught(name, imported):
    assert violations(name, imported) == sorted(imported)


def test_relative_and_in_function_imports_are_seen(tmp_path, monkeypatch):
    package = tmp_path / "rawserve"
    (package / "engine").mkdir(parents=True)
    module = package / "engine" / "scheduler.py"
    module.write_text("def f():\n    import asyncio\n    from ..http import sse\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert {"asyncio", "rawserve.http", "rawserve.http.sse"} <= imports_of(module)


def modules_imported(path: pathlib.Path, known: set[str]) -> set[str]:
    """The rawserve modules (names in `known`) that `path` imports, anywhere in it. `from a import b` is an
    import of a.b where that is a module, else of a (b is a name in a): `from rawserve.http import sse` needs
    sse.py, not rawserve/http/__init__.py. An import under `if TYPE_CHECKING:` counts: it never runs, but it
    still ties the two modules together."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return (found & known) - {name}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import one another round a circle (a strongly connected component of more
    than one module), sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


def test_no_import_circles_among_rawserve_modules():
    """A circle (function-level imports included) means neither module can be read, moved or loaded alone."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: modules_imported(path, set(paths)) for name, path in paths.items()}
    assert "rawserve.demo" in graph["rawserve.cli"]  # a function-level import: the walk sees those
    assert not import_circles(graph), f"modules that import one another: {import_circles(graph)}"


def test_a_circle_through_a_function_level_import_is_caught(tmp_path, monkeypatch):
    package = tmp_path / "rawserve"
    (package / "engine").mkdir(parents=True)
    for name in ("__init__.py", "engine/__init__.py", "engine/loop.py", "engine/launch.py", "engine/leaf.py"):
        (package / name).write_text("")
    (package / "engine" / "launch.py").write_text("def run():\n    from rawserve.engine.loop import run_core\n")
    (package / "engine" / "loop.py").write_text("from . import leaf\nfrom .launch import describe\n")
    (package / "engine" / "leaf.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from rawserve.engine.rules import Rule\n")
    (package / "engine" / "rules.py").write_text("from rawserve.engine.leaf import Leaf\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    paths = {module_name(path): path for path in package.rglob("*.py")}
    graph = {name: modules_imported(path, set(paths)) for name, path in paths.items()}
    assert graph["rawserve.engine.loop"] == {"rawserve.engine.leaf", "rawserve.engine.launch"}
    assert import_circles(graph) == [["rawserve.engine.launch", "rawserve.engine.loop"],
                                     ["rawserve.engine.leaf", "rawserve.engine.rules"]]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_server_process_loads_no_torch():
    """The API names the core through engine/launch.py, so only the core's thread or process loads torch."""
    code = "import sys, rawserve.__main__, rawserve.api.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False", out.stderr
