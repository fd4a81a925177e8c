"""Helpers the engine tests of the newer model families share: a float32 CPU core over a checkpoint, greedy
params, transformers' greedy continuation, and stepping a core until its requests end."""
from __future__ import annotations

import torch

from rawserve.config import EngineConfig
from rawserve.engine.core import EngineCore
from rawserve.engine.types import SamplingParams


def make_core(model_dir, block_size: int, **options) -> EngineCore:
    defaults = dict(model_dir=str(model_dir), device="cpu", dtype="float32", block_size=block_size,
                    num_kv_blocks=256, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256)
    return EngineCore(EngineConfig(**{**defaults, **options}))


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def hf_greedy(hf, ids: list[int], max_tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of `ids` (no EOS: as greedy() ignores it)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


def step_to_end(core: EngineCore, max_steps: int = 2000, on_step=None) -> tuple[dict, dict]:
    """Step until no request is left -> ({rid: output ids}, {rid: final RequestOutput})."""
    tokens: dict[str, list[int]] = {}
    final = {}
    for _ in range(max_steps):
        if not core.has_unfinished:
            return tokens, final
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
        if on_step is not None:
            on_step(core)
    raise AssertionError("engine did not finish")
