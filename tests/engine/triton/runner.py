"""Runs the triton case files (this folder) for the tests that check them (their triton_cases marker;
tests/conftest.py): one subprocess for every case file that runs the same way (one interpreter, torch and triton
start-up, where each file had its own), in the background at the lowest CPU priority when the suite runs (on the
cores the rest of the session leaves idle; restarted at normal priority if it has not ended when a test needs it).
Each test then waits for and checks its own file's cases.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
CASES = pathlib.Path(__file__).resolve().parent
# Case files that run under TRITON_INTERPRET=1 on CPU tensors even where a GPU is present (the others run on
# CUDA tensors when there is one).
ALWAYS_INTERPRETED = frozenset({"kv_dtype_cases.py"})
TIMEOUT_S = 600


@dataclass
class FileResult:
    passed: int = 0
    problems: list[str] = field(default_factory=list)  # "failure: case (message)", ..., then the run's output


def _clean(text: str) -> list[str]:
    # triton's bindings print reference-leak notes at interpreter exit: noise, kept out of the report
    return [line for line in text.splitlines() if "leaked" not in line and not line.startswith(" - ")]


# pytest at the lowest CPU priority, for background work: it gets the CPU time the session's tests leave, and
# barely slows them where they compete.
_NICE_PYTEST = "import os, sys, pytest; os.nice(19); sys.exit(pytest.main(sys.argv[1:]))"


class _Group:
    """One pytest subprocess over some case files, its output in files (a pipe nobody reads could fill and stall it)."""

    def __init__(self, names: list[str], interpreted: bool, directory: pathlib.Path, background: bool) -> None:
        self.names = names
        self.env = dict(os.environ)
        self.env.pop("TRITON_INTERPRET", None)
        if interpreted:
            self.env["TRITON_INTERPRET"] = "1"
        if background:  # one core at most beside the session's tests (the interpreter runs one thread anyway)
            self.env["OMP_NUM_THREADS"] = "1"
        self.report_xml = directory / f"report-{int(interpreted)}.xml"
        self.stdout = open(directory / f"stdout-{int(interpreted)}.txt", "w+")
        self.stderr = open(directory / f"stderr-{int(interpreted)}.txt", "w+")
        self.background = background
        self._start()

    def _start(self) -> None:
        start = [sys.executable, "-c", _NICE_PYTEST] if self.background else [sys.executable, "-m", "pytest"]
        self.proc = subprocess.Popen([*start, "-q", "-p", "no:cacheprovider", "-rs",
                                      f"--junitxml={self.report_xml}", *(str(CASES / name) for name in self.names)],
                                     cwd=ROOT, env=self.env, stdout=self.stdout, stderr=self.stderr, text=True)

    def _restart_in_the_foreground(self) -> None:
        """A background run still going when its results are wanted is starting over at normal priority: at the
        lowest it could crawl behind other work on a busy machine, where a fresh run is no slower than no
        background run at all."""
        self.proc.kill()
        self.proc.wait()
        self.report_xml.unlink(missing_ok=True)
        for out in (self.stdout, self.stderr):
            out.seek(0)
            out.truncate()
        self.background = False
        self.env.pop("OMP_NUM_THREADS", None)
        self._start()

    def results(self) -> dict[str, FileResult]:
        if self.background and self.proc.poll() is None:
            self._restart_in_the_foreground()
        try:
            returncode = self.proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            returncode = self.proc.wait()
        results = {name: FileResult() for name in self.names}
        if self.report_xml.exists():
            for case in ET.parse(self.report_xml).getroot().iter("testcase"):
                name = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
                if name not in results:
                    continue
                outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
                if outcome is None:
                    results[name].passed += 1
                else:
                    results[name].problems.append(f"{outcome.tag}: {case.get('name')} "
                                                  f"({(outcome.get('message') or '')[:300]})")
        self.stdout.seek(0)
        self.stderr.seek(0)
        out = _clean(self.stdout.read())
        report = "\n".join(out[-40:] + _clean(self.stderr.read())[-20:])
        for result in results.values():
            if not result.passed and not result.problems:  # no report (a crash, a timeout), or none of its cases ran
                result.problems.append(f"no case ran (exit status {returncode})")
            if result.problems:
                result.problems.append(report)
        return results

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stdout.close()
        self.stderr.close()


class CaseRun:
    """The case files `names`, started now: in one subprocess per way of running (interpreted or on CUDA), at the
    lowest CPU priority if `background`."""

    def __init__(self, names: set[str], background: bool) -> None:
        self.names = frozenset(names)
        self._tmp = tempfile.TemporaryDirectory(prefix="rawserve-triton-cases-")
        on_gpu = torch.cuda.is_available()
        by_mode: dict[bool, list[str]] = {}
        for name in sorted(names):
            by_mode.setdefault(not on_gpu or name in ALWAYS_INTERPRETED, []).append(name)
        self._groups = [_Group(group, interpreted, pathlib.Path(self._tmp.name), background)
                        for interpreted, group in by_mode.items()]
        self._results: dict[str, FileResult] | None = None

    def results(self) -> dict[str, FileResult]:
        """{case file: its result}, once every subprocess has ended."""
        if self._results is None:
            self._results = {}
            for group in self._groups:
                self._results.update(group.results())
        return self._results

    def stop(self) -> None:
        for group in self._groups:
            group.stop()
        self._tmp.cleanup()
