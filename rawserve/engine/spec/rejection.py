"""Rejection sampling of one row's drafts (Leviathan et al., 2023) from probability tensors: the emitted tokens
follow the target's distribution whatever the draft distribution was. Torch over [k, V] rows; no requests.
"""
from __future__ import annotations

import torch

from rawserve.engine import vocab_ops


def rejection_sample(target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None,
                     uniforms: torch.Tensor, generator: torch.Generator | None = None) -> list[int]:
    """target_probs: [k + 1, V], row j the target's final distribution (every processor and truncation applied)
    after the drafts before j; draft_probs: [k, V] the proposer's distribution each draft was drawn from, or None
    for a proposer that drafts one token (a point mass: q(d) = 1); uniforms: [k] one per draft.

    Draft j is accepted with probability min(1, p(d) / q(d)); the first rejected one is replaced by a draw from
    max(p - q, 0) renormalised, and the run ends there. When every draft is accepted, the target's row k gives
    one more token. Returns the emitted tokens (1 to k + 1)."""
    k = len(draft_tokens)
    out: list[int] = []
    if k:
        drafts = torch.tensor(draft_tokens, dtype=torch.int64, device=target_probs.device)
        p = target_probs[:k].gather(1, drafts.unsqueeze(1)).squeeze(1)  # [k]
        q = draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1) if draft_probs is not None else torch.ones_like(p)
        # u < p / q, written as u * q < p so a draft with q = 0 (never drawn by that proposer) is only accepted
        # when p > 0 too; a point mass's q is 1.
        accept = (uniforms[:k] * q < p).tolist()
        for j in range(k):
            if not accept[j]:
                if draft_probs is not None:
                    residual = (target_probs[j] - draft_probs[j]).clamp_(min=0)
                else:
                    residual = target_probs[j].clone()
                    residual[draft_tokens[j]] = 0
                return out + [_draw(residual, generator)]
            out.append(draft_tokens[j])
    return out + [_draw(target_probs[k].clone(), generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalised non-negative weights [V] (vocab_ops.draw: the sampler's own inverse-CDF draw)."""
    u = torch.rand(1, generator=generator, device=weights.device)
    return int(vocab_ops.draw(weights.unsqueeze(0), u)[0])
