"""Shared test fixtures: paths to ../shared/fixtures (RAWSERVE_TEST_FIXTURES overrides), tiny checkpoint builders
(a Qwen3-shaped tokenizer and checkpoint built without fixtures), a numpy-less environment for subprocesses and
the triton case files' results (started in the background when collection ends); and the run's exit hook."""
from __future__ import annotations

import gc
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# RAWSERVE_TEST_FIXTURES points the tests elsewhere (a missing path shows what a fresh clone runs).
FIXTURES = pathlib.Path(os.environ.get("RAWSERVE_TEST_FIXTURES") or ROOT.parent / "shared" / "fixtures")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton_cases(name): the test checks tests/engine/triton/<name>, run in a "
                                       "subprocess by the triton_case_result fixture")


_TRITON_RUN = pytest.StashKey()
# Tests ahead of the first triton case test in the run: with this many, its case files start in the background
# when collection ends; with fewer (a run of one file, say) they start when that test needs them.
_TRITON_BACKGROUND_AFTER = 100


def _triton_run(session: pytest.Session, background: bool):
    """The session's run of every triton case file its tests check (their triton_cases marker), started once."""
    from tests.engine.triton.runner import CaseRun

    run = session.config.stash.get(_TRITON_RUN, None)
    if run is None:
        names = {marker.args[0] for item in session.items for marker in item.iter_markers("triton_cases")}
        run = session.config.stash[_TRITON_RUN] = CaseRun(names, background)
    return run


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the triton case files at the lowest CPU priority when the whole suite (or much of it) runs: ~30 s of
    interpreted kernels on a core the tests before them mostly leave idle (the suite's process tree used ~0.8 of
    2 cores), done, or nearly, by the time their tests come."""
    if session.config.option.collectonly:
        return
    first = next((i for i, item in enumerate(session.items) if item.get_closest_marker("triton_cases")), None)
    if first is not None and first >= _TRITON_BACKGROUND_AFTER:
        _triton_run(session, background=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.stash.get(_TRITON_RUN, None)
    if run is not None:  # ended, or killed when the session stops before its tests are reached
        run.stop()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Hand back to the collector what the engines built in this process froze (EngineCore calls gc.freeze(), as
    a server's core should): frozen objects are never freed at interpreter exit, and triton's bindings, which
    transformers loads, would report each one they still hold as a `nanobind: leaked ...` line after the summary."""
    gc.unfreeze()


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    if not FIXTURES.is_dir():
        pytest.skip("../shared/fixtures is absent")
    return FIXTURES


def fixture_path(*parts: str) -> pathlib.Path:
    """A path under ../shared/fixtures, or a clean skip when it is absent."""
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"fixture {path} is absent")
    return path


# On sys.path through PYTHONPATH, so it runs first in every process a test starts, spawned cores included.
_NO_NUMPY = """import sys


class NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoNumpy())
"""


@pytest.fixture
def numpy_absent_env(tmp_path) -> dict[str, str]:
    """Environment variables under which `import numpy` fails in every process started with them, as on a base
    install (numpy is no dependency of rawserve; the test extra installs it for triton's interpreter)."""
    site = tmp_path / "no-numpy"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_NO_NUMPY)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> pathlib.Path:
    """A 2-layer random Qwen3 checkpoint (vocab 256, hidden 64, 4 heads, 2 KV heads, head_dim 32)."""
    from tests.checkpoints import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def tiny_qwen3_with_tokenizer(directory: pathlib.Path, tokenizer_dir: pathlib.Path,
                               max_positions: int = 2048) -> pathlib.Path:
    """A tiny random Qwen3 (hidden 32) with Qwen3's 151,936-row embedding, eos and generation_config, and the
    tokenizer files of `tokenizer_dir` (and the guided-decoding vocabulary index its core would build at start,
    reused across runs: tests/checkpoints.reuse_vocab_index)."""
    import json
    import shutil

    from tests.checkpoints import make_hf_checkpoint, reuse_vocab_index

    make_hf_checkpoint(directory, "qwen3", tied=True, vocab_size=151936, hidden_size=32, intermediate_size=64,
                       head_dim=16, bos_token_id=None, eos_token_id=151645, max_position_embeddings=max_positions)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    reuse_vocab_index(directory, 151936)
    return directory


@pytest.fixture(scope="session")
def qwen3_real_tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random Qwen3 (hidden 32) with the real Qwen3 tokenizer, template and 151,936-row vocabulary."""
    source = fixture_path("qwen3-tokenizer")
    return tiny_qwen3_with_tokenizer(tmp_path_factory.mktemp("qwen3-real-tok"), source)


@pytest.fixture(scope="session")
def large_vocab_tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """A Qwen3-shaped tokenizer built here (tests/checkpoints.write_qwen_like_tokenizer): 151,669 byte-level BPE
    tokens, Qwen3's added tokens at Qwen3's ids and flags, the demo's ChatML template. Needs no fixtures."""
    from tests.checkpoints import write_qwen_like_tokenizer

    return write_qwen_like_tokenizer(tmp_path_factory.mktemp("large-vocab-tok"))


@pytest.fixture(scope="session")
def large_vocab_model_dir(tmp_path_factory, large_vocab_tokenizer_dir) -> pathlib.Path:
    """qwen3_real_tokenizer_dir's shape with the built tokenizer: for tests of a checkpoint of that shape (a
    151,936-row vocabulary, marker tokens, ChatML) that need no real tokenizer's ids. 4,096 positions: its
    vocabulary, trained on little text, takes up to 1.5x Qwen3's tokens for English and JSON."""
    return tiny_qwen3_with_tokenizer(tmp_path_factory.mktemp("large-vocab-model"), large_vocab_tokenizer_dir,
                                      max_positions=4096)


@pytest.fixture
def triton_case_result(request):
    """The result of the case file this test's triton_cases marker names (.passed, a count, and .problems), from
    the session's run of them (tests/engine/triton/runner.py), started now if collection did not start it."""
    name = request.node.get_closest_marker("triton_cases").args[0]
    return _triton_run(request.session, background=False).results()[name]
