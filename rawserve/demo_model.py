"""Builds the tiny demo checkpoint (a BPE tokenizer trained on packaged text + a random Qwen3 model)
and caches it per content hash. It never touches the network, and the same inputs give the same
bytes; the random-weight writer here is also what bench/ uses for large shapes."""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import importlib.metadata
import importlib.resources
import json
import logging
import math
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Any, Iterable, Iterator, Sequence

from rawserve.logs import Progress, ignore_torch_numpy_warning

log = logging.getLogger("rawserve.demo_model")

# Fixed ids 0..6, whatever the corpus: the trainer puts its special tokens first, in this order.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added but not special (as in Qwen3), so they survive skip_special_tokens and reach the parsers.
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
TOKENIZER_VOCAB_SIZE = 2000
DEMO_SEED = 0
DEMO_MAX_POSITIONS = 4096
DEMO_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json")
INIT_STD = 0.02
# `rawserve serve` without a checkpoint serves this model with these defaults, for the flags the user left unset.
# The checkpoint allows 4,096 positions and the engine 256 sequences by default: 1M tokens, a 2 GiB KV pool (and as
# much resident after an abuse burst) for a model of 1M parameters. 32 x 1,024 is 64 MiB at float32.
DEMO_SERVING_DEFAULTS = {"max_num_seqs": 32, "max_model_len": 1024}

# name -> (torch dtype name, safetensors dtype tag, bytes per element)
_DTYPES = {"float32": ("float32", "F32", 4), "bfloat16": ("bfloat16", "BF16", 2),
           "float16": ("float16", "F16", 2)}


@dataclasses.dataclass(frozen=True, slots=True)
class Qwen3Shape:
    """The architecture numbers of a Qwen3 checkpoint; one field = one config.json key."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (type(value) is not int or value <= 0):
                raise ValueError(f"{field.name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")


def demo_shape(vocab_size: int) -> Qwen3Shape:
    return Qwen3Shape(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=DEMO_MAX_POSITIONS)


# ---- random weights -------------------------------------------------------------------------------

def qwen3_tensor_shapes(shape: Qwen3Shape) -> list[tuple[str, tuple[int, ...]]]:
    """HF Qwen3 tensor names and shapes, sorted by name (the order the writer stores them in)."""
    h = shape.hidden_size
    q_dim = shape.num_attention_heads * shape.head_dim
    kv_dim = shape.num_key_value_heads * shape.head_dim
    specs = [("model.embed_tokens.weight", (shape.vocab_size, h)), ("model.norm.weight", (h,))]
    if not shape.tie_word_embeddings:
        specs.append(("lm_head.weight", (shape.vocab_size, h)))
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q_dim, h)),
            (p + "self_attn.k_proj.weight", (kv_dim, h)),
            (p + "self_attn.v_proj.weight", (kv_dim, h)),
            (p + "self_attn.o_proj.weight", (h, q_dim)),
            (p + "self_attn.q_norm.weight", (shape.head_dim,)),
            (p + "self_attn.k_norm.weight", (shape.head_dim,)),
            (p + "mlp.gate_proj.weight", (shape.intermediate_size, h)),
            (p + "mlp.up_proj.weight", (shape.intermediate_size, h)),
            (p + "mlp.down_proj.weight", (h, shape.intermediate_size)),
        ]
    return sorted(specs)


def _tensor_seed(seed: int, name: str) -> int:
    # Seeded per tensor, not per file position: a tensor's values depend only on (seed, name, shape).
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# Elements per generation step; a fixed constant because it fixes which draw lands where.
_CHUNK_ELEMENTS = 1 << 22
# Irwin-Hall: a sum of 4 uniform int16 values has mean 4 * -0.5 and variance 4 * (2**32 - 1) / 12.
_SUM_MEAN = -2
_SUM_STD = math.sqrt((2**32 - 1) / 3)


def random_weight_chunks(name: str, dims: tuple[int, ...], seed: int, dtype: str) -> Iterator:
    """The values of one tensor, flattened, as CPU tensors of at most _CHUNK_ELEMENTS each.

    Matrices are near-normal with mean 0 and std INIT_STD: each value is a sum of four
    uniform int16 (Irwin-Hall, bounded at +-3.46 std) times one constant. Why not normal_(): its
    Box-Muller log/cos differ in the last bit between torch's scalar and AVX2 kernels (measured
    with ATEN_CPU_CAPABILITY=default), so the bytes would depend on the CPU. Integer draws, an
    exact int->float conversion and one IEEE multiply are the same everywhere. Norms are 1.
    """
    ignore_torch_numpy_warning()  # a first build may be the process's first torch import (the server's, the demo's)
    import torch

    numel, out_dtype = _numel(dims), getattr(torch, dtype)
    if len(dims) == 1:  # RMSNorm gains start at 1, as in HF's init
        yield torch.ones(numel, dtype=out_dtype)
        return
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
    # A float32-representable scale: float32 * float32 is exact in double, so a kernel that multiplies
    # in double and rounds once gives the same bits as one that multiplies in float32.
    scale = torch.tensor(INIT_STD / _SUM_STD, dtype=torch.float32).item()
    for start in range(0, numel, _CHUNK_ELEMENTS):
        count = min(_CHUNK_ELEMENTS, numel - start)
        # One full-range 64-bit draw per element, read as four int16 (little-endian, checked by the caller).
        bits = torch.empty(count, dtype=torch.int64).random_(-2**63, None, generator=generator)  # [count]
        total = bits.view(torch.int16).view(count, 4).sum(dim=1, dtype=torch.int32)  # [count], exact
        # |total - mean| < 2**17, so the float32 conversion is exact and the multiply rounds once.
        values = (total - _SUM_MEAN).to(torch.float32).mul_(scale)  # [count]
        # Every dtype rounds these same float32 values; no kernel chooses between one rounding and two.
        yield values.to(out_dtype)


def write_random_safetensors(path: str | pathlib.Path, specs: Sequence[tuple[str, tuple[int, ...]]], *,
                             seed: int, dtype: str = "float32") -> pathlib.Path:
    """Write a safetensors file of random tensors, streaming a few MB at a time.

    We write the format ourselves (8-byte header length, JSON header, raw little-endian data)
    because safetensors.torch.save_file needs every tensor in memory at once: 2.4 GB for the
    0.6B shape.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this writer needs a little-endian host")
    torch_dtype, tag, item_bytes = _DTYPES[dtype]
    names = [name for name, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    # Name order and this field order are what safetensors.torch.save_file writes for one dtype,
    # so the bytes equal the library's (tests check it).
    specs = sorted(specs)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in specs:
        num_bytes = item_bytes * _numel(dims)
        header[name] = {"dtype": tag, "shape": list(dims), "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the spec pads the header to 8-byte alignment
    path = pathlib.Path(path)
    with open(path, "wb") as f, Progress(f"writing {path.name}", offset, log) as progress:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for name, dims in specs:
            for chunk in random_weight_chunks(name, dims, seed, torch_dtype):
                chunk = chunk.contiguous()
                # A zero-copy view of the chunk's memory; `chunk` stays alive until the write returns.
                f.write((ctypes.c_char * chunk.nbytes).from_address(chunk.data_ptr()))
                progress.update(chunk.nbytes)
    return path


def _numel(dims: Iterable[int]) -> int:
    count = 1
    for d in dims:
        count *= d
    return count


def qwen3_config(shape: Qwen3Shape, *, dtype: str, bos_token_id: int | None, eos_token_id: int) -> dict:
    """config.json in the layout of a published Qwen3 checkpoint."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "head_dim": shape.head_dim, "hidden_size": shape.hidden_size, "initializer_range": INIT_STD,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "max_window_layers": shape.num_hidden_layers, "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers, "num_key_value_heads": shape.num_key_value_heads,
        "rms_norm_eps": shape.rms_norm_eps, "rope_scaling": None, "rope_theta": shape.rope_theta,
        "sliding_window": None, "tie_word_embeddings": shape.tie_word_embeddings, "torch_dtype": dtype,
        "use_cache": True, "use_sliding_window": False, "vocab_size": shape.vocab_size,
    }


def write_json(path: str | pathlib.Path, obj: Any) -> None:
    # sort_keys and a fixed layout: these files are hashed, so their bytes must not drift.
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    pathlib.Path(path).write_text(text, encoding="utf-8")


def write_qwen3_checkpoint(directory: str | pathlib.Path, shape: Qwen3Shape, *, seed: int,
                           dtype: str = "float32", bos_token_id: int | None, eos_token_id: int,
                           generation_config: dict) -> pathlib.Path:
    """Write config.json, generation_config.json and model.safetensors with random weights."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / "config.json",
               qwen3_config(shape, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id))
    write_json(directory / "generation_config.json", generation_config)
    write_random_safetensors(directory / "model.safetensors", qwen3_tensor_shapes(shape), seed=seed,
                             dtype=dtype)
    return directory


# ---- tokenizer ------------------------------------------------------------------------------------

def _data_file(name: str):
    return importlib.resources.files("rawserve").joinpath("data").joinpath(name)


def corpus_texts() -> list[tuple[str, str]]:
    """(file name, text) of the packaged training corpus, in name order."""
    folder = importlib.resources.files("rawserve").joinpath("data")
    files = sorted((f for f in folder.iterdir() if f.name.startswith("corpus_") and f.name.endswith(".txt")),
                   key=lambda f: f.name)
    if not files:
        raise FileNotFoundError("rawserve/data/corpus_*.txt is missing: the package was installed "
                                "without its data files")
    return [(f.name, f.read_text(encoding="utf-8")) for f in files]


def chat_template() -> str:
    """The demo model's ChatML template (tools, tool calls, reasoning_content, enable_thinking)."""
    return _data_file("demo_chat_template.txt").read_text(encoding="utf-8")


def train_tokenizer(texts: Sequence[str], vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """Train the byte-level BPE tokenizer; returns a `tokenizers.Tokenizer`.

    Measured, not assumed: the output is byte-identical across processes, hash seeds and
    RAYON_NUM_THREADS 1..16 (tokenizers 0.23), so no single-threaded subprocess is needed.
    tests/test_demo_model.py rebuilds with one thread in a fresh process to keep that true.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    reserved = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + ADDED_TOKENS]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=reserved,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # The trainer marks every reserved token special; re-adding keeps the id and clears the flag.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    # Reload from the serialized form so the object behaves exactly like the file we write.
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    for expected_id, token in enumerate(SPECIAL_TOKENS + ADDED_TOKENS):
        assert tokenizer.token_to_id(token) == expected_id, token
    return tokenizer


def tokenizer_config(template: str) -> dict:
    """tokenizer_config.json in Qwen's layout, with our own chat template."""
    decoder = {
        str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": token in SPECIAL_TOKENS}
        for i, token in enumerate(SPECIAL_TOKENS + ADDED_TOKENS)
    }
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": template, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace", "model_max_length": DEMO_MAX_POSITIONS, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None,
    }


# ---- build, hash, cache ---------------------------------------------------------------------------

def build_demo_model(directory: str | pathlib.Path) -> pathlib.Path:
    """Write the five demo files into `directory` (created if needed) and return it."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    log.info("building the demo model in %s (once; it is cached): training its tokenizer", directory)
    tokenizer = train_tokenizer([text for _, text in corpus_texts()])
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    # Padded to a multiple of 64 as Qwen pads 151669 tokens to 151936. The padding rows are random
    # too, so an unmasked sampler can pick an id the tokenizer has no token for.
    vocab_size = -(-num_tokens // 64) * 64
    end_of_text, im_end = (tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>"))
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    write_json(directory / "tokenizer_config.json", tokenizer_config(chat_template()))
    generation = {"do_sample": True, "eos_token_id": [im_end, end_of_text], "pad_token_id": end_of_text,
                  "temperature": 0.7, "top_p": 0.9}
    write_qwen3_checkpoint(directory, demo_shape(vocab_size), seed=DEMO_SEED, dtype="float32",
                           bos_token_id=None, eos_token_id=im_end, generation_config=generation)
    return directory


def builder_inputs_hash() -> str:
    """A short hash of everything the demo bytes depend on: this code, the packaged data, and the
    versions of the libraries that train and draw them. A change to any of them means a new cache entry.

    The versions come from the installed packages' metadata (the same strings as their __version__), not
    from importing them: the server's process finds its cached model here and must load no torch."""
    digest = hashlib.sha256()
    parts = [("source", pathlib.Path(__file__).read_bytes()), ("template", chat_template().encode()),
             ("tokenizers", importlib.metadata.version("tokenizers").encode()),
             ("torch", importlib.metadata.version("torch").encode())]
    parts += [(name, text.encode()) for name, text in corpus_texts()]
    for label, blob in parts:
        digest.update(f"{label}:{len(blob)}:".encode())
        digest.update(blob)
    return digest.hexdigest()[:16]


def default_cache_dir() -> pathlib.Path:
    # XDG_CACHE_HOME only says where the standard user cache lives; it changes no behaviour.
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "rawserve"


def apply_demo_defaults(config: Any, argv: Sequence[str]) -> str | None:
    """Set DEMO_SERVING_DEFAULTS on an EngineConfig for each flag neither `argv` nor the environment set (a value
    other than the flag's own default); returns the sentence the server logs, or None when none applied."""
    named = {arg.split("=", 1)[0] for arg in argv}
    applied = []
    for name, value in DEMO_SERVING_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        if flag in named or getattr(config, name) != type(config).__dataclass_fields__[name].default:
            continue
        setattr(config, name, value)
        applied.append(f"{flag} {value}")
    if not applied:
        return None
    return (f"demo model: {', '.join(applied)} by default, so its KV pool fits a 1M-parameter model (the engine's "
            f"defaults, 256 sequences x 4096 tokens, would make it 1M tokens, 2 GiB at float32); set the flags to "
            f"change it")


def ensure_demo_model(cache_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """The demo checkpoint directory, built once into `<cache_dir>/demo-<hash>`.

    `cache_dir` defaults to $XDG_CACHE_HOME/rawserve (~/.cache/rawserve). The build goes to a
    temporary sibling that is renamed into place, so a reader never sees a half-written model and
    concurrent builders agree: the first rename wins and the others discard their identical copy.
    """
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"demo-{builder_inputs_hash()}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        os.chmod(staging, 0o755)  # mkdtemp makes 0700; the cache entry is an ordinary directory
        build_demo_model(staging)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():  # not the lost race: a real failure (permissions, disk)
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def tree_sha256(directory: str | pathlib.Path, names: Sequence[str] = DEMO_FILES) -> str:
    """sha256 over (name, size, bytes) of `names` in `directory`, in the given order."""
    digest = hashlib.sha256()
    for name in names:
        path = pathlib.Path(directory) / name
        digest.update(f"{name}:{path.stat().st_size}:".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rawserve.demo_model",
                                     description="Build the tiny random-weight demo checkpoint (no network).")
    parser.add_argument("directory", nargs="?", help="Where to write it. Default: the user cache, built once.")
    args = parser.parse_args(argv)
    from rawserve.logs import setup_logging

    setup_logging("info")  # the build's progress on stderr; stdout keeps the path and digest
    path = build_demo_model(args.directory) if args.directory else ensure_demo_model()
    print(path.resolve())
    print(f"sha256 {tree_sha256(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
