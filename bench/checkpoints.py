"""Random-weight checkpoints with real model shapes for benchmarks (Qwen3-0.6B), cached under the
repo's .bench_models/. It only names shapes and caches them: the weights come from rawserve.demo_model.

Run: python -m bench.checkpoints [--dtype float32|bfloat16|float16] [--directory DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from rawserve import demo_model
from rawserve.demo_model import Qwen3Shape, write_qwen3_checkpoint

log = logging.getLogger("bench.checkpoints")

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE_ROOT = REPO_ROOT / ".bench_models"


def _fixtures_root() -> pathlib.Path:
    """../shared/fixtures beside the checkout, or RAWSERVE_TEST_FIXTURES (as for the tests), or a shared/fixtures inside
    the checkout where there is one: only a shared/ inside the checkout reaches a device machine (bench/gpu_check.sh
    says what to copy there)."""
    if os.environ.get("RAWSERVE_TEST_FIXTURES"):
        return pathlib.Path(os.environ["RAWSERVE_TEST_FIXTURES"])
    inside = REPO_ROOT / "shared" / "fixtures"
    return inside if inside.is_dir() else REPO_ROOT.parent / "shared" / "fixtures"


QWEN3_TOKENIZER = _fixtures_root() / "qwen3-tokenizer"

QWEN3_06B = Qwen3Shape(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True)
# llama.cpp's side-by-side tiny model (../shared/peers/make_checkpoint.py TINY): the 152k vocabulary dominates.
QWEN3_TINY = Qwen3Shape(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=True)
SHAPES = {"0.6b": QWEN3_06B, "tiny": QWEN3_TINY}
SEED = 0
# Qwen3's ids: <|endoftext|> 151643, <|im_end|> 151645; sampling defaults as Qwen3-0.6B publishes them.
QWEN3_BOS, QWEN3_EOS = 151643, 151645
QWEN3_GENERATION = {"bos_token_id": QWEN3_BOS, "do_sample": True, "eos_token_id": [QWEN3_EOS, QWEN3_BOS],
                    "pad_token_id": QWEN3_BOS, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def write_qwen3_06b_shape(directory: str | pathlib.Path, dtype: str = "float32", shape: str = "0.6b") -> pathlib.Path:
    """Write a random Qwen3-0.6B-shaped (or `shape` "tiny") checkpoint into `directory` and return it.

    Tensors are drawn and written one at a time, so peak memory is about the largest tensor
    (the 151936 x 1024 embedding: 622 MB in float32), not the 2.4 GB of weights.
    """
    directory = write_qwen3_checkpoint(directory, SHAPES[shape], seed=SEED, dtype=dtype, bos_token_id=QWEN3_BOS,
                                       eos_token_id=QWEN3_EOS, generation_config=QWEN3_GENERATION)
    copy_qwen3_tokenizer(directory)
    return directory


def copy_qwen3_tokenizer(directory: pathlib.Path) -> bool:
    """Copy the real Qwen3 tokenizer files next to the weights when the fixtures are present.

    Each file lands by rename, so a reader never sees half a tokenizer.json. Returns whether it
    is there afterwards.
    """
    if not QWEN3_TOKENIZER.is_dir():
        log.info("no %s: the checkpoint has no tokenizer (fine for forward benchmarks)", QWEN3_TOKENIZER)
        return (directory / "tokenizer.json").exists()
    for source in sorted(QWEN3_TOKENIZER.iterdir()):
        target = directory / source.name
        if source.is_file() and not target.exists():
            partial = directory / f".{source.name}.partial"
            shutil.copyfile(source, partial)
            os.replace(partial, target)
    return True


def _inputs_hash(dtype: str, shape: str = "0.6b") -> str:
    # The bytes depend on the writer's code, this file's shape and seed, and torch's RNG.
    import torch

    digest = hashlib.sha256()
    for blob in (pathlib.Path(demo_model.__file__).read_bytes(), pathlib.Path(__file__).read_bytes(),
                 torch.__version__.encode(), dtype.encode(), shape.encode()):
        digest.update(len(blob).to_bytes(8, "little") + blob)
    return digest.hexdigest()[:12]


def ensure_qwen3_06b_shape(dtype: str = "float32", cache_dir: str | pathlib.Path | None = None,
                           shape: str = "0.6b") -> pathlib.Path:
    """The cached Qwen3-0.6B-shaped (or `shape` "tiny") checkpoint for `dtype`, written once under .bench_models/.

    Built into a hidden sibling and renamed into place, so an interrupted build leaves no
    half-written entry. Older entries of the same dtype (from a changed writer) are removed:
    each is 1.2-2.4 GB.
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    root = pathlib.Path(cache_dir) if cache_dir is not None else CACHE_ROOT
    prefix = f"qwen3-{shape}-shape-{dtype}-"
    final = root / f"{prefix}{_inputs_hash(dtype, shape)}"
    if not final.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            os.chmod(staging, 0o755)
            log.info("writing %s (about 2.4 GB in float32; once)", final)
            write_qwen3_06b_shape(staging, dtype, shape)
            try:
                os.rename(staging, final)
            except OSError:
                if not final.is_dir():  # not a lost race with another builder: a real failure
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for stale in root.glob(f"{prefix}*"):
            if stale != final and stale.is_dir():
                log.info("removing stale %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
    copy_qwen3_tokenizer(final)  # the fixtures may have appeared since the entry was built
    return final


def rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--directory", default=None,
                        help="Write here instead of the .bench_models/ cache (always rewrites).")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    start = time.perf_counter()
    if args.directory:
        path = write_qwen3_06b_shape(args.directory, args.dtype)
    else:
        path = ensure_qwen3_06b_shape(args.dtype)
    elapsed_s = time.perf_counter() - start
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    print(json.dumps({
        "bench": "checkpoints", "shape": "qwen3-0.6b", "dtype": args.dtype, "path": str(path),
        "weight_bytes": (path / "model.safetensors").stat().st_size,
        "has_tokenizer": (path / "tokenizer.json").exists(), "seconds": round(elapsed_s, 2),
        "peak_rss_mb": round(peak_rss_mb, 1), "rev": rev(),
    }))


if __name__ == "__main__":
    main()
