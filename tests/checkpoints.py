"""Tiny random Hugging Face checkpoints for tests, written with transformers (the reference).

Each family the loader supports has a builder; they write config.json, generation_config.json
and model.safetensors exactly as `save_pretrained` does, so the loader reads real files.
"""
from __future__ import annotations

import json
import pathlib

FAMILIES = ("qwen3", "qwen2", "llama")


def make_hf_checkpoint(directory: str | pathlib.Path, family: str = "qwen3", *, tied: bool = False,
                       seed: int = 0, dtype: str = "float32", **overrides) -> pathlib.Path:
    """Write a tiny random `family` checkpoint into `directory` and return its path."""
    import torch
    import transformers

    directory = pathlib.Path(directory)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        config = transformers.Qwen3Config(**{**common, "head_dim": 32, "rope_theta": 10000.0, **overrides})
        model_cls = transformers.Qwen3ForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**{**common, "rope_theta": 10000.0, **overrides})
        model_cls = transformers.Qwen2ForCausalLM
    elif family == "llama":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        config = transformers.LlamaConfig(**{**common, "rope_theta": 500000.0, "rope_scaling": scaling,
                                             "rms_norm_eps": 1e-5, **overrides})
        model_cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make them count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    gen = {"eos_token_id": [2], "bos_token_id": 1}
    (directory / "generation_config.json").write_text(json.dumps(gen))
    return directory


def load_hf_model(directory: str | pathlib.Path, dtype: str = "float32"):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    return model.eval()


# ---- a Qwen3-shaped tokenizer built here, for tests that need its shape and not its trained data ----------------

# Qwen2/2.5/3's added tokens (ids 151643..151668) and which of them are special; the texts, ids and flags of a
# published Qwen3 checkpoint, so a test that names an id (151645 <|im_end|>, 151667 <think>) reads the same here.
QWEN_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
QWEN_REGULAR_TOKENS = 151643
QWEN_VOCAB_SIZE = 151936  # the embedding rows of a Qwen3 config: the 151,669 tokens padded
# Qwen2's pre-tokenizer split (public, in every Qwen tokenizer.json).
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable character map (printable bytes stand for themselves, the rest from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbol = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in symbol:
            symbol[b] = chr(256 + len(symbol) - len(printable))
    return symbol


def qwen_like_vocab(num_merges: int = QWEN_REGULAR_TOKENS - 256) -> tuple[list[str], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of 256 + `num_merges` tokens and its merges, the same every run: the demo
    tokenizer's merges trained on rawserve's packaged corpus (so English splits into words), runs of 2..128
    spaces (Qwen's longest token is 128 spaces), the CJK characters U+4E00..U+9FFF whole, every pair of bytes
    (tokens that hold part of a UTF-8 character), words of up to 3 letters, then printable ASCII triples until the count is reached."""
    from rawserve.demo_model import corpus_texts, train_tokenizer

    to_symbol = _byte_symbols()
    vocab = sorted(to_symbol.values())  # ids 0..255 in the order byte-level vocabularies use ("!" is 0)
    known = set(vocab)
    merges: list[tuple[str, str]] = []

    def add(left: str, right: str) -> None:
        token = left + right
        if len(merges) < num_merges and token not in known and left in known and right in known:
            known.add(token)
            vocab.append(token)
            merges.append((left, right))

    trained = json.loads(train_tokenizer([text for _, text in corpus_texts()], vocab_size=20000).to_str())["model"]["merges"]
    for left, right in (m.split(" ", 1) if isinstance(m, str) else m for m in trained):
        add(left, right)
    space = to_symbol[0x20]
    for n in range(1, 128):
        add(space * n, space)
    # A CJK character's lead pair and then the whole character rank before the other byte pairs, so BPE builds
    # it from the front (its tail pair would otherwise merge first and leave the lead byte alone).
    cjk = [[to_symbol[b] for b in chr(cp).encode("utf-8")] for cp in range(0x4E00, 0xA000)]
    for first, second, _ in cjk:
        add(first, second)
    for first, second, third in cjk:
        add(first + second, third)
    for a in range(256):
        for b in range(256):
            add(to_symbol[a], to_symbol[b])
    # Lowercase words of up to 3 letters, with and without a leading space, whole: English and JSON keys take
    # about as many tokens as with Qwen's vocabulary, so a prompt that fits Qwen3's context fits this one.
    lower, upper = "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for lead in (space, ""):
        for a in lower + upper:
            for b in lower:
                add(lead + a, b)
        for a in lower + upper:
            for b in lower:
                for c in lower:
                    add(lead + a + b, c)
    ascii_symbols = [to_symbol[b] for b in range(0x20, 0x7F)]
    for a in ascii_symbols:
        for b in ascii_symbols:
            for c in ascii_symbols:
                if len(merges) == num_merges:
                    return vocab, merges
                add(a + b, c)
    raise ValueError(f"cannot reach {num_merges} merges")


def write_bpe_tokenizer_json(directory: pathlib.Path, vocab: list[str], merges: list, added: list[dict],
                             split_regex: str, normalizer: dict | None) -> None:
    """A byte-level BPE tokenizer.json: the split regex, then byte-level, as Qwen's and gpt-oss's are built."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    data = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split_regex}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {token: i for i, token in enumerate(vocab)}, "merges": [list(m) for m in merges]},
    }
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def added_tokens_decoder(added: list[dict]) -> dict:
    """tokenizer_config.json's added_tokens_decoder for tokenizer.json's added_tokens."""
    return {str(entry["id"]): {k: entry[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word",
                                                     "special")} for entry in added}


def write_qwen_like_tokenizer(directory: str | pathlib.Path, chat_template: str | None = None) -> pathlib.Path:
    """tokenizer.json and tokenizer_config.json of a Qwen3-shaped tokenizer built here, with no trained data
    beyond rawserve's corpus: Qwen2's pipeline (NFC, Qwen2's split, byte-level BPE), 151,643 regular tokens and
    Qwen3's 26 added tokens at Qwen3's ids with Qwen3's special flags; the demo's ChatML template by default
    (tools, <tool_call>, reasoning_content, enable_thinking). Its ids for text are not Qwen3's."""
    from rawserve.demo_model import chat_template as demo_chat_template

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = qwen_like_vocab()
    added = [{"id": QWEN_REGULAR_TOKENS + i, "content": text, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": special}
             for i, (text, special) in enumerate(QWEN_ADDED_TOKENS)]
    write_bpe_tokenizer_json(directory, vocab, merges, added, _QWEN_SPLIT, {"type": "NFC"})
    decoder = added_tokens_decoder(added)
    config = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
              "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
              "chat_template": demo_chat_template() if chat_template is None else chat_template,
              "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
              "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
              "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                     encoding="utf-8")
    return directory


# ---- tiny random vision-language checkpoints (Qwen3.5, Qwen3-VL) with the real tokenizers and templates ---------

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "shared" / "fixtures"
# Patch 16, merge 2 and temporal patch 2 as published; a 4 x 4 learned position grid, so every image interpolates.
# Weights drawn wider than transformers' 0.02, so the image (and DeepStack's features) move the text's greedy ids.
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                   temporal_patch_size=2, num_position_embeddings=16, initializer_range=0.2)
# Small min/max pixels (published: 65,536 and 16,777,216), so test images stay at a few dozen tokens.
TINY_PREPROCESSOR = {"size": {"shortest_edge": 64 * 64, "longest_edge": 192 * 192}, "patch_size": 16,
                     "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                     "image_std": [0.5, 0.5, 0.5], "do_rescale": True, "rescale_factor": 1 / 255,
                     "do_normalize": True, "do_convert_rgb": True, "resample": 3,
                     "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor"}


def _fixtures_dir() -> pathlib.Path:
    for root in (FIXTURES, pathlib.Path("/work/shared/fixtures")):
        if root.is_dir():
            return root
    raise FileNotFoundError(f"{FIXTURES}: the shared fixtures are missing")


def _write_vl(directory: pathlib.Path, model, tokenizer: str, seed: int, preprocessor: dict | None) -> None:
    """Randomise what transformers' init leaves neutral, save, and add the tokenizer files and processor config."""
    import shutil

    import torch

    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name and (name.endswith(("norm.weight", "norm1.weight", "norm2.weight"))):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "visual" in name and name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif "visual" in name and name.endswith("pos_embed.weight"):
                param.copy_(0.5 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    source = _fixtures_dir() / tokenizer
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / file, directory / file)
    (directory / "preprocessor_config.json").write_text(json.dumps({**TINY_PREPROCESSOR, **(preprocessor or {})}))
    reuse_vocab_index(directory, model.config.text_config.vocab_size)


def reuse_vocab_index(directory: pathlib.Path, vocab_size: int) -> None:
    """Put the guided-decoding vocabulary index each EngineCore reads at start into the checkpoint, built once per
    tokenizer and vocabulary size (under the temp dir, across runs): building it for the real 248k-token vocabularies
    takes 5-20 s (2 s for 152k), and every fresh checkpoint would otherwise pay it. The file is the one the core
    writes itself (named by the tokenizer files' hash), so what the core reads is unchanged."""
    import hashlib
    import os
    import shutil
    import tempfile

    from rawserve.engine.guided.vocab import is_vocab_index_cached, load_vocab_index

    files = ("tokenizer.json", "tokenizer_config.json")
    digest = hashlib.sha256(str(vocab_size).encode())
    for name in files:
        digest.update((directory / name).read_bytes())
    built = pathlib.Path(tempfile.gettempdir()) / f"rawserve-test-vocab-{os.getuid()}" / digest.hexdigest()[:16]
    if not is_vocab_index_cached(built, vocab_size):
        built.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copy(directory / name, built / name)
        load_vocab_index(built, vocab_size)  # writes it beside the copied tokenizer
    for index in built.glob(".rawserve-vocab-*.pt"):
        shutil.copy(index, directory / index.name)


def make_qwen35_vl_checkpoint(directory: str | pathlib.Path, *, seed: int = 0, vision: dict | None = None,
                              preprocessor: dict | None = None, **text_overrides) -> pathlib.Path:
    """A tiny random Qwen3_5ForConditionalGeneration (hybrid text stack, vision tower under model.visual) with
    Qwen3.5's tokenizer layout and chat template (../shared/fixtures/qwen35-tokenizer): the vocabulary is the
    real 248,320 rows, so the image placeholder (248056) and the vision markers are the published ids."""
    import torch
    import transformers

    from tests.qwen35_checkpoints import TINY_TEXT

    directory = pathlib.Path(directory)
    text = {**TINY_TEXT, "vocab_size": 248320, "eos_token_id": 248046, "bos_token_id": None,
            "initializer_range": 0.1, "tie_word_embeddings": True, **text_overrides}
    vis = {**TINY_VISION, "out_hidden_size": text["hidden_size"], **(vision or {})}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vis, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():  # as make_qwen35_checkpoint: norms and the delta rule's parameters away from neutral
        for name, param in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("norm.weight"):
                param.copy_((1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + 0.2 * torch.randn_like(param))
            elif name.endswith(("dt_bias", "conv1d.weight")):
                param.copy_(0.5 * torch.randn_like(param))
    _write_vl(directory, model, "qwen35-tokenizer", seed, preprocessor)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    return directory


def make_qwen3_vl_checkpoint(directory: str | pathlib.Path, *, seed: int = 0, vision: dict | None = None,
                             preprocessor: dict | None = None, **text_overrides) -> pathlib.Path:
    """A tiny random Qwen3VLForConditionalGeneration (Qwen3 text stack with interleaved M-RoPE, a vision tower
    with DeepStack mergers feeding the first text layers) with Qwen3's tokenizer and template
    (../shared/fixtures/qwen3-tokenizer): image placeholder 151655, vocabulary 151,936 rows."""
    import torch
    import transformers

    directory = pathlib.Path(directory)
    text = {**dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                   rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                                    "mrope_interleaved": True}), **text_overrides}
    vis = {**TINY_VISION, "depth": 3, "out_hidden_size": text["hidden_size"], "deepstack_visual_indexes": [0, 1],
           **(vision or {})}
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vis, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" not in name and name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    _write_vl(directory, model, "qwen3-tokenizer", seed, preprocessor)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return directory


def load_hf_vl(directory: str | pathlib.Path, dtype: str = "float32"):
    """transformers' model for a checkpoint from make_qwen35_vl_checkpoint or make_qwen3_vl_checkpoint."""
    import torch
    import transformers

    arch = json.loads((pathlib.Path(directory) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(directory, dtype=getattr(torch, dtype)).eval()


def hf_image_processor(directory: str | pathlib.Path):
    """transformers' PIL image processor (no torchvision needed) reading the checkpoint's preprocessor_config.json."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(directory)


# ---- mixture-of-experts checkpoints (models/moe.py) ----------------------------------------------------------------

MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "gpt_oss")


def make_moe_checkpoint(directory: str | pathlib.Path, family: str = "qwen3_moe", *, seed: int = 0,
                        dtype: str = "float32", stacked: bool = False, **overrides) -> pathlib.Path:
    """Write a tiny random MoE checkpoint (transformers' own classes and save_pretrained) and return its path.

    qwen3_moe: 3 layers, the middle one dense (mlp_only_layers), 8 experts top-2. qwen3_5_moe: the conditional-
    generation form (text under model.language_model), 4 layers (3 Gated DeltaNet + 1 attention), 8 experts top-2
    and a shared expert. gpt_oss: 4 layers alternating sliding (window 6) and full attention, 8 experts top-2,
    attention sinks, YaRN, a SwiGLU clamp its activations reach. The routers, sinks and norms get random values wide enough that routing is decided by
    the input (transformers' init would leave near-ties). stacked: rewrite the experts as one [E, ...] tensor per
    matrix (transformers' in-memory form) rather than save_pretrained's per-expert tensors."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    directory = pathlib.Path(directory)
    torch.manual_seed(seed)  # transformers' init draws from the global generator
    common = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  initializer_range=0.1,  # larger than 0.02: greedy ids then vary from token to token
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  num_experts_per_tok=2)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{**common, "intermediate_size": 96, "moe_intermediate_size": 32,
                                                "num_experts": 8, "num_hidden_layers": 3, "mlp_only_layers": [1],
                                                "norm_topk_prob": True, "tie_word_embeddings": False, **overrides})
        model = transformers.Qwen3MoeForCausalLM(config)
    elif family == "qwen3_5_moe":
        text = {**common, "head_dim": 32, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                "num_experts": 8, "num_hidden_layers": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 24, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **overrides}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    elif family == "gpt_oss":
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 16}
        config = transformers.GptOssConfig(**{**common, "intermediate_size": 32, "num_local_experts": 8,
                                              "num_hidden_layers": 4, "sliding_window": 6, "rope_parameters": rope,
                                              # 7.0 in gpt-oss; this small a limit clamps tiny random activations too
                                              "swiglu_limit": 0.5,
                                              "tie_word_embeddings": False, **overrides})
        model = transformers.GptOssForCausalLM(config)
    else:
        raise ValueError(f"unknown MoE family {family!r}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("norm.weight"):
                base = 0.0 if family == "qwen3_5_moe" and not name.endswith("linear_attn.norm.weight") else 1.0
                param.copy_(base + 0.2 * torch.randn_like(param))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param.copy_(0.5 * torch.randn_like(param))
            elif name.endswith(("sinks", ".bias", "dt_bias", "conv1d.weight")):
                param.copy_(0.5 * torch.randn_like(param))
            elif "experts" in name or "shared_expert" in name:
                param.copy_(0.1 * torch.randn_like(param))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True)
    if stacked:
        _stack_experts(directory, load_file, save_file)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "bos_token_id": 1}))
    return directory


def _stack_experts(directory: pathlib.Path, load_file, save_file) -> None:
    """Rewrite model.safetensors with each layer's per-expert tensors as stacked [E, 2I, H] and [E, H, I]."""
    import re

    import torch

    tensors = load_file(str(directory / "model.safetensors"))
    out, experts = {}, {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = tensor
    for prefix, parts in experts.items():
        count = len(parts["gate_proj"])
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((parts["gate_proj"][e], parts["up_proj"][e]))
                                                     for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(count)])
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})


def load_hf_moe(directory: str | pathlib.Path, family: str, dtype: str = "float32"):
    import torch
    import transformers

    cls = transformers.Qwen3_5MoeForConditionalGeneration if family == "qwen3_5_moe" \
        else transformers.AutoModelForCausalLM
    return cls.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
