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


def prompt_logprobs_against_hf(core: EngineCore, hf, ids: list[int], max_tokens: int = 3) -> tuple[list, torch.Tensor]:
    """Run `ids` greedily with logprobs=2 and prompt_logprobs=2 and check every prompt logprob against
    transformers' over the same ids (rtol 0, atol 1e-4) -> (the step outputs, transformers' log-softmax rows over
    prompt + generated) for a caller's further checks."""
    core.add_request("lp", ids, greedy(max_tokens, logprobs=2, prompt_logprobs=2))
    outs = []
    while core.has_unfinished:
        outs += core.step()
    generated = [t for out in outs for t in out.new_token_ids]
    with torch.no_grad():
        ref = hf(torch.tensor([ids + generated])).logits[0].float().log_softmax(-1)
    plp = outs[0].prompt_logprobs  # sent once, with the first token
    assert len(plp) == len(ids) and plp[0] is None
    got = torch.tensor([plp[i][1] for i in range(1, len(ids))])
    assert [plp[i][0] for i in range(1, len(ids))] == ids[1:]
    torch.testing.assert_close(got, ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], rtol=0, atol=1e-4)
    return outs, ref
