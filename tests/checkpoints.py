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
