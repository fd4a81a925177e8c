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
        "rawserve.engine.launch", "rawserve.engine.cpu_budget", *(f"rawserve.engine.guided.{name}" for name in (
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


def test_the_server_process_loads_no_torch():
    """The API names the core through engine/launch.py, so only the core's thread or process loads torch."""
    code = "import sys, rawserve.__main__, rawserve.api.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False", out.stderr
