"""Tiny random Qwen3.5 checkpoints for tests, written with transformers (the reference): the text-only
Qwen3_5ForCausalLM form and the Qwen3_5ForConditionalGeneration form (text under model.language_model, a
small vision tower under model.visual, plus mtp.* tensors as real checkpoints carry them)."""
from __future__ import annotations

import json
import pathlib

# Both layer kinds twice over (3 linear + 1 full, repeated), grouped value heads (2 key heads, 4 value heads),
# and head sizes that differ between the two kinds, so a mixed-up shape cannot pass.
TINY_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                 rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
                 linear_num_key_heads=2, linear_num_value_heads=4, bos_token_id=1, eos_token_id=2,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                  "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def make_qwen35_checkpoint(directory: str | pathlib.Path, *, conditional: bool = False, tied: bool = True,
                           seed: int = 0, dtype: str = "float32", mtp: bool = True, max_shard_size: str | None = None,
                           bigram: bool = False, **overrides) -> pathlib.Path:
    """Write a tiny random Qwen3.5 checkpoint into `directory` and return its path.

    Every norm and the delta rule's decay/step parameters get random values (transformers' init leaves norms at
    their neutral value, which would hide a (1 + weight) vs weight mix-up).
    bigram: every mixer's and MLP's output projection zeroed, so the residual stream is the token's embedding and
    the next token a function of the last one alone (what add_mtp_block(predicts_next=True) reproduces)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    directory = pathlib.Path(directory)
    text = {**TINY_TEXT, "tie_word_embeddings": tied, **overrides}
    if conditional:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                      patch_size=8, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tied)
        model_cls = transformers.Qwen3_5ForConditionalGeneration
    else:
        config = transformers.Qwen3_5TextConfig(**text)
        model_cls = transformers.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("norm.weight"):
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0  # the gated norm scales by w
                param.copy_(base + 0.2 * torch.randn_like(param))
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif name.endswith("conv1d.weight"):
                param.copy_(0.5 * torch.randn_like(param))
            if bigram and name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                param.zero_()
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True,
                          **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if mtp:  # what real checkpoints carry beside the model (transformers drops it on load): a file of its own
        hidden = text["hidden_size"]
        save_file({"mtp.fc.weight": torch.randn(hidden, 2 * hidden).to(getattr(torch, dtype)),
                   "mtp.norm.weight": torch.randn(hidden).to(getattr(torch, dtype))},
                  str(directory / "model-mtp.safetensors"))
        _add_to_index(directory, ["mtp.fc.weight", "mtp.norm.weight"], "model-mtp.safetensors", load_file)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "bos_token_id": 1}))
    return directory


def add_mtp_block(directory: str | pathlib.Path, *, predicts_next: bool = False, seed: int = 1) -> pathlib.Path:
    """Write a complete mtp.* block into `directory`'s model-mtp.safetensors (replacing make_qwen35_checkpoint's
    partial one), under real Qwen3.5 checkpoints' names (../shared/peers/README.md): fc [H, 2H], the three norms,
    and one gated full-attention decoder layer. Random, or with predicts_next (for a bigram=True checkpoint):
    fc takes the normed embedding only, the layer adds nothing, and mtp.norm is the target's final norm, so the
    draft after token t is the target's own next token after t."""
    import torch
    from safetensors.torch import load_file, save_file

    directory = pathlib.Path(directory)
    config = json.loads((directory / "config.json").read_text())
    text = config.get("text_config", config)
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    dtype = getattr(torch, text.get("dtype") or text.get("torch_dtype") or "float32")
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    layer = "mtp.layers.0."
    tensors = {
        "mtp.fc.weight": rand(hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": rand(hidden, scale=0.2),
        "mtp.pre_fc_norm_hidden.weight": rand(hidden, scale=0.2), "mtp.norm.weight": rand(hidden, scale=0.2),
        layer + "input_layernorm.weight": rand(hidden, scale=0.2),
        layer + "post_attention_layernorm.weight": rand(hidden, scale=0.2),
        layer + "self_attn.q_proj.weight": rand(2 * heads * head_dim, hidden),
        layer + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        layer + "self_attn.q_norm.weight": rand(head_dim, scale=0.2),
        layer + "self_attn.k_norm.weight": rand(head_dim, scale=0.2),
        layer + "mlp.gate_proj.weight": rand(inter, hidden), layer + "mlp.up_proj.weight": rand(inter, hidden),
        layer + "mlp.down_proj.weight": rand(hidden, inter)}
    if predicts_next:
        weights = {}
        for file in directory.glob("model*.safetensors"):
            if file.name != "model-mtp.safetensors":
                weights.update(load_file(str(file)))
        final = next(w for name, w in weights.items() if name.endswith("norm.weight") and ".layers." not in name
                     and not name.startswith(("mtp.", "model.visual.")))
        tensors["mtp.fc.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
        tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
        tensors["mtp.norm.weight"] = final.float().clone()
        tensors[layer + "self_attn.o_proj.weight"].zero_()
        tensors[layer + "mlp.down_proj.weight"].zero_()
    save_file({name: t.to(dtype).contiguous() for name, t in tensors.items()}, str(directory / "model-mtp.safetensors"))
    _add_to_index(directory, list(tensors), "model-mtp.safetensors", load_file)
    return directory


def _add_to_index(directory: pathlib.Path, names: list[str], file: str, load_file) -> None:
    """List the extra file in an index (written from the single file when save_pretrained wrote none)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
    else:
        data = {"metadata": {}, "weight_map": {name: "model.safetensors"
                                               for name in load_file(str(directory / "model.safetensors"))}}
    data["weight_map"].update({name: file for name in names})
    index.write_text(json.dumps(data))


def load_hf_qwen35(directory: str | pathlib.Path, *, conditional: bool = False, dtype: str = "float32"):
    import torch
    import transformers

    cls = transformers.Qwen3_5ForConditionalGeneration if conditional else transformers.Qwen3_5ForCausalLM
    return cls.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
