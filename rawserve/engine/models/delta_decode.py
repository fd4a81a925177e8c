"""Gated DeltaNet's one-token forms, for a step of decodes only (DeltaPlan.all_decode): the conv window, the per-head
scaled l2 norm and the recurrent step with q and k side by side (its decay kept in the state's scale), each in as
few torch calls as the arithmetic allows (at one row a call costs more than its arithmetic). Pure torch, no model
weights; gated_delta owns the plan and the states' layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rawserve.engine.models.gated_delta import DeltaPlan, state_reads


def decode_conv(x: torch.Tensor, taps: torch.Tensor, conv_state: torch.Tensor, plan: DeltaPlan) -> torch.Tensor:
    """causal_conv for a step of decodes only (plan.all_decode): one new input per sequence.

    x: [B, C]; taps: [K, C] float32; conv_state: [num_slots, K - 1, C]. -> [B, C] float32. Each sequence's window
    (its K - 1 saved inputs, then the new one) is one [B, K, C] tensor of contiguous rows: the conv is one
    product and one sum over it, and its last K - 1 rows are the new state, one copy. At one row the per-tap form
    was two dozen calls (a multiply-add, a state column shifted and a slice or two per tap), and a state laid out
    [C, K - 1] made every one of them a strided pass (the window's sum over a last dim of K ran 10x slower at 32
    rows). The window is made float32 before the product: a bf16 x float32 product runs ~10x slower."""
    num_seqs = x.shape[0]
    run = plan.slot_run
    saved = conv_state[run:run + num_seqs] if run is not None else conv_state.index_select(0, plan.slots)
    window = torch.cat((saved, x.unsqueeze(1)), 1)  # [B, K, C]
    if run is not None:
        saved.copy_(window[:, 1:])
    else:
        conv_state.index_copy_(0, plan.slots, window[:, 1:])
    # (a float32 window is the cat's own tensor, read nowhere else once the state is copied out of it)
    return F.silu(window.float().mul_(taps).sum(1), inplace=True)


def scaled_l2_normalize(x: torch.Tensor, eps: torch.Tensor, inv_scale_sq: torch.Tensor) -> torch.Tensor:
    """l2_normalize times a factor per head: x [B, 2, H, d] (q's heads, then k's; any strides) times
    rsqrt(sum(x^2) inv_scale_sq + eps) = scale rsqrt(sum(x^2) + 1e-6) with eps = 1e-6 inv_scale_sq; eps and
    inv_scale_sq [2, H] (scale: 1 on k's heads, dk^-0.5 on q's, where inv_scale_sq = dk is a power of two and the
    product is exact). -> a new contiguous [B, H, 2, d]: each head's q and k side by side, the layout the rule's
    state reads take their weights in (gated_delta.state_reads reads them in place; x scaled in place, a column
    slice of the conv's rows, was copied into it there, one more pass)."""
    batch, _, heads, d = x.shape
    sums = torch.linalg.vecdot(x, x)  # [B, 2, H]
    out = x.new_empty((batch, heads, 2, d))
    torch.mul(x, torch.addcmul(eps, sums, inv_scale_sq).rsqrt_().unsqueeze(-1), out=out.transpose(1, 2))
    return out


# The stored recurrent state is the true one divided by its slot's scale per head (gated_delta's module docstring),
# kept in [FOLD_BELOW, 1]: a scale that would fall below is folded into the stored state and reset to 1. So a stored
# value is at most 2^64 times its true one, and its reads (dk <= 256 products) another 2^4: float32 (to 2^128) holds
# them for any state and value under 2^58 (a true state holds, per key direction, a decayed mix of values; a model's
# are ~1). A decay of exactly 0 folds to a zero state, as the plain form gives. The fold is a pass over a head's
# rows: at 32 rows 13% of the heads fold a step on bench.qwen35_forward's random 0.8B (decays e^-0.01 .. e^-11 a
# token), 22% on the peers' (transformers' init), which leaves the scaled form 1-4.5% of the 32-row step (one
# thread, steady state; the box's noise is of that size), where dropping the decay pass alone would be ~5%.
FOLD_BELOW = 2.0 ** -64
_FOLD_BOUND = torch.tensor(FOLD_BELOW)  # (as a tensor: a Python float operand is wrapped into one each call)
# Fewer rows than this fold every step (the plain two-pass form, scale 1): the scaled form's calls (the fold check,
# the division) cost more than one pass over a few rows' states saves.
SCALED_MIN_ROWS = 8


def decode_rule(qk: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """recurrent_step for a step of decodes, q and k side by side, in place on `states` [B, H, dk, dv] (float32,
    the pool's rows of the step's slots as a view) and their `scale` [B, H, 1, 1] (the true state is
    scale * states).

    qk: [B, H, 2, dk] (each head's q, normalised and scaled, then its k; contiguous, or its state reads copy it);
    v: [B, H, 1, dv]; decay (exp g), beta: [B, H, 1, 1]. -> [B, H, 1, dv]. The same algebra as recurrent_step
    with S = c T (T stored, c the scale): one pass reads q T and k T (state_reads); with c' = c d the new state is
    c' (T + k delta^T / c'), so the decay goes into the scale and the rank-1 write is the stored state's only other
    pass (read and written once, where the plain form's decay made a second). Every operand keeps the state's four
    dims, so no call goes to reshaping one (at one row each call costs more than its arithmetic)."""
    num_seqs = v.shape[0]
    q_read, k_read = state_reads(qk, states).split(1, 2)  # [B, H, 1, dv] each, of the stored state
    scale_new = scale * decay  # c': the true state's factor once this token's decay is applied
    delta = torch.addcmul(v, scale_new, k_read, value=-1).mul_(beta)  # [B, H, 1, dv]
    q, k = qk.split(1, 2)  # [B, H, 1, dk] each
    k_col = k.transpose(-1, -2)  # [B, H, dk, 1]
    # q.k [B, H, 1, 1] as a product and a sum: matmul made it one 1 x dk by dk x 1 gemm per (sequence, head), 3.5x
    # the time at 32 rows
    out = torch.addcmul(q_read.mul_(scale_new), (q * k).sum(-1, keepdim=True), delta)
    if num_seqs < SCALED_MIN_ROWS or not states.is_cpu:  # every row folded: the plain decay pass, scale 1
        # (off a CPU so too: there the fold check would wait for the device)
        states.mul_(scale_new)
        states.addcmul_(k_col, delta)
        scale.fill_(1.0)
        return out
    # Which heads fold, as a list of bools: four calls, where the mask's nonzero indices took six (a CPU runs ops
    # eagerly, so the list waits on nothing). (Not each head's minimum over the rows: a broken row's NaN scale
    # would hide the other rows' from it.)
    folds = torch.lt(scale_new, _FOLD_BOUND).view(num_seqs, -1).any(0).tolist()
    for h, fold in enumerate(folds):
        if fold:  # a head's rows in one strided pass each (a gather of the rows that fold, then a scatter, cost
            # more), every row of it folded: the pass is paid, and the head's rows then fall in step, so the next
            # fold comes with its fastest row's (folding only the rows below the bound left 44% of the heads folding
            # a step at 32 rows, where 12% of the rows needed it)
            head_scale = scale_new.select(1, h)  # [B, 1, 1]
            states.select(1, h).mul_(head_scale)
            head_scale.fill_(1.0)
    states.addcmul_(k_col, delta.div_(scale_new))
    scale.copy_(scale_new)
    return out


def decode_rule_at(qk: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                   recurrent: torch.Tensor, scale: torch.Tensor, plan: DeltaPlan) -> torch.Tensor:
    """decode_rule for a step of decodes only (plan.all_decode) wherever their slots lie in recurrent
    [num_slots, H, dk, dv] and its scale [num_slots, H, 1, 1]: in place on their run (plan.slot_run); on the run
    of slots they span, with identity rows between (plan.decode_span: decay 1, beta 0 and k 0 leave a true state
    as it was; a fold of its head multiplies it by its scale, then 1); else gathered and written back. Arguments
    as decode_rule's, in batch order. -> [B, H, 1, dv]."""
    num_seqs = v.shape[0]
    if plan.slot_run is not None:
        first = plan.slot_run
        run = slice(first, first + num_seqs)
        return decode_rule(qk, v, decay, beta, recurrent[run], scale[run])
    if plan.decode_span is not None:
        first, count = plan.decode_span

        def laid(x: torch.Tensor, pad: float) -> torch.Tensor:  # [B, ...] -> [count, ...] in slot order
            return torch.cat((x, x.new_full((1, *x.shape[1:]), pad))).index_select(0, plan.decode_span_rows)

        run = slice(first, first + count)
        o = decode_rule(laid(qk, 0.0), laid(v, 0.0), laid(decay, 1.0), laid(beta, 0.0), recurrent[run], scale[run])
        return o.index_select(0, plan.decode_place)
    pool = recurrent.view(recurrent.shape[0], -1)  # (a 4-D index_select copied rows several times slower)
    states = pool.index_select(0, plan.slots).view(num_seqs, *recurrent.shape[1:])
    scales = scale.index_select(0, plan.slots)
    o = decode_rule(qk, v, decay, beta, states, scales)
    pool.index_copy_(0, plan.slots, states.view(num_seqs, -1))
    scale.index_copy_(0, plan.slots, scales)
    return o
