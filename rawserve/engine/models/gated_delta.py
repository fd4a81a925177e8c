"""Gated DeltaNet's sequence ops over a flattened batch: the causal depthwise conv with per-sequence conv state,
and the gated delta rule (chunked for prefill rows, one recurrent step for decode rows) over per-sequence
recurrent states. Pure torch, no model weights: a layer hands in its projections and the step's DeltaPlan.

The states live outside the model, one row per slot: conv [num_slots, kernel - 1, conv_dim] (the last inputs of
the conv, at the model's dtype), recurrent [num_slots, num_v_heads, head_k_dim, head_v_dim] (float32) and its scale
[num_slots, num_v_heads, 1, 1] (float32): a sequence's true recurrent state is scale * recurrent. A step of decodes
only keeps its decays in the scale (delta_decode.decode_rule: the stored state then takes one read-and-write pass
a token, not two); everything else reads and writes true states, so it folds the scale in first (fold_scales) or
copies it with the state (ModelRunner.copy_states). Scales start at 1 and stay in [delta_decode.FOLD_BELOW, 1].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Tokens per chunk of the chunked delta rule. bench/qwen35_forward.py measures 32/64/128 on the 0.8B shapes.
CHUNK_SIZE = 64
# Tokens of a prefill group the chunked rule takes at once (whole rounds: a round is never split). Its per-chunk
# intermediates (the chunked q, k, v, the [C, C] decays, system, inverse and scores, the state reads) are about
# 80 KB a token on Qwen3.5-0.8B in float32: 650 MiB over an 8,192-token step, 85 MiB a window of 1,024.
# 0: the whole group at once.
RULE_WINDOW_TOKENS = 1024


@dataclass(slots=True)
class StateBatch:
    """The engine's word on each sequence's linear-attention state this step, in batch order.

    A sequence's state slot is held for its whole life (prefill chunks and decodes); `fresh` says its state
    must start from zeros this step (no token of it computed yet: num_computed_tokens == 0). A state restored
    from a prefix cache, or carried from the previous chunk, is not fresh."""

    slots: list[int]
    fresh: list[bool]

    @classmethod
    def from_inputs(cls, seqs: list) -> StateBatch:
        """From the step's StepInputs (their state_slot and num_computed_tokens)."""
        return cls([seq.state_slot for seq in seqs], [seq.num_computed_tokens == 0 for seq in seqs])


@dataclass(slots=True)
class PrefillGroup:
    """Prefill sequences scanned by one chunked_rule call: all fresh (zero_start) or all carried, their lengths in
    one size class (prefill_size_class), cut into chunks of `chunk_size` (each sequence padded to whole chunks)
    ordered chunk index first, so the chunks of the scan's i-th round are one contiguous run, its sequences the
    first `num_active` of `slots` (longest first)."""

    slots: torch.Tensor  # [num_seqs] int64 state slots, longest first (equal lengths: lowest slot first)
    zero_start: bool  # fresh sequences: chunked_rule's zero_start
    chunk_size: int
    rounds: list[tuple[int, int]]  # per chunk index: (first chunk, sequences that have it)
    chunk_gather: torch.Tensor  # [num_chunks * chunk_size] token row per chunk position (0: pad)
    chunk_pads: torch.Tensor | None  # [num_chunks, 1, chunk_size] bool: pad positions (None: none)
    tokens: torch.Tensor  # [num_group_tokens] the group's token rows, ascending
    positions: torch.Tensor  # [num_group_tokens] each one's chunk position
    slot_run: int | None = None  # slots are slot_run, slot_run + 1, ...: the rule scans the pool's rows in place
    # (rows per token, heads) -> flat row indices of the chunked layout (chunk_rows), and (-1, heads) -> the rows
    # from_chunks reads back: every layer has the same
    gathers: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


def prefill_size_class(length: int, chunk_size: int) -> int:
    """Prefills share a group (and its chunk size) by class: up to 16 tokens, up to 32, longer. A step's 16-token
    prompt tails beside longer prompts would otherwise be padded to the longer ones' 64-token chunks, 4x the
    work in every product of the rule (and 16x in the [C, C] ones); finer classes would mean more calls."""
    return min(chunk_size, max(16, 1 << (length - 1).bit_length()))


@dataclass(slots=True)
class DeltaPlan:
    """One step's layout for every Gated DeltaNet layer, built once (plan_delta_step) and shared by them.

    Conv: one shifted multiply-add over the step's new rows as they lie, which is each row's window but for the
    first kernel - 1 rows of each sequence; those are redone from the sequence's "edges" (its saved inputs, then
    its first and last kernel - 1 new rows, gathered small), which also give its new conv state.
    Delta rule: decode rows (one new token) take the recurrent step together; prefill rows are cut into
    chunks, one layout per PrefillGroup: fresh ones (no token computed yet), which the rule starts from zeros
    without reading a state, apart from carried ones, and each by size class.
    """

    slots: torch.Tensor  # [num_seqs] int64 state slot of each sequence
    fresh_slots: torch.Tensor | None  # int64 slots whose conv state starts from zeros this step
    carried_slots: torch.Tensor | None  # int64 slots whose states carry into this step (the rest are fresh)
    fresh_recurrent: torch.Tensor | None  # int64 slots whose recurrent state must be zeroed before the rule reads it
    # the conv's edges are cat(saved inputs [num_seqs * (kernel - 1)], new rows at conv_edge_rows); causal_conv's
    # rows, None on a step of decodes only (which takes delta_decode.decode_conv)
    conv_edge_rows: torch.Tensor | None  # token rows: each sequence's first, then (if more) last kernel - 1
    conv_state_index: torch.Tensor | None  # [num_seqs * (kernel - 1)] edge rows that become each sequence's state
    conv_head_index: torch.Tensor | None  # [num_seqs * 2 (kernel - 1)] edge rows: saved inputs, first new rows (padded)
    conv_head_valid: torch.Tensor | None  # rows of the heads' [num_seqs * (kernel - 1)] outputs that are tokens' ...
    conv_head_rows: torch.Tensor | None  # ... and those tokens' rows
    decode_tokens: torch.Tensor | None  # [num_decodes] token rows of the one-token sequences
    decode_slots: torch.Tensor | None  # [num_decodes] their slots
    decode_span: tuple[int, int] | None  # (first slot, count): the decodes' slots lie in this run of the pool
    decode_span_rows: torch.Tensor | None  # [count] token row of each slot of the run (num_tokens: not a decode)
    decode_place: torch.Tensor | None  # [num_decodes] each decode's place in the run
    groups: list[PrefillGroup]  # the prefill sequences (none: a step of decodes)
    num_tokens: int
    all_decode: bool = False  # every sequence has one new token
    slot_run: int | None = None  # the slots are first, first + 1, ... in batch order: the pool's rows as a view


def decode_span(tokens: list[int], slots: list[int], num_tokens: int
                ) -> tuple[tuple[int, int] | None, list[int] | None, list[int] | None]:
    """Where the decodes' recurrent states can be updated in place: the run of pool slots from the lowest to the
    highest, when it is not much longer than the decodes (slots in the run that are not this step's decodes take
    an identity update, g = beta = 0 and k = 0: their state is read and written back unchanged). Else None: the
    states are gathered and scattered back. -> (first, count), token row per run slot, run place per decode."""
    lo, count = min(slots), max(slots) - min(slots) + 1
    if count > max(2 * len(slots), len(slots) + 8):
        return None, None, None
    rows = [num_tokens] * count
    for token, slot in zip(tokens, slots):
        rows[slot - lo] = token
    return (lo, count), rows, [slot - lo for slot in slots]


def run_start(slots: list[int]) -> int | None:
    """The first of `slots` when they are consecutive (first, first + 1, ...): a run of the pool that a layer reads
    and writes as a view. None otherwise, or for no slots."""
    if not slots:
        return None
    first = slots[0]
    return first if slots == list(range(first, first + len(slots))) else None


def plan_decodes(state: StateBatch, device: torch.device) -> DeltaPlan:
    """plan_delta_step for a step of decodes only (one new token per sequence): what GatedDeltaNetLayer.decode
    reads, the decode rows' fields (gated_delta_rule takes any plan), and no conv history (decode_conv reads the
    saved inputs where they lie). Where the slots run in batch order the layer reads the pool's rows as a view, and
    the span's rows and places are not built."""
    slots = state.slots
    num_seqs = len(slots)
    slot_run = run_start(slots)
    slots_t = torch.tensor(slots, dtype=torch.int64, device=device)
    fresh = [slot for slot, is_fresh in zip(slots, state.fresh) if is_fresh]
    fresh_t = torch.tensor(fresh, dtype=torch.int64, device=device) if fresh else None
    carried = [slot for slot, is_fresh in zip(slots, state.fresh) if not is_fresh]
    carried_t = slots_t if not fresh else torch.tensor(carried, dtype=torch.int64, device=device) if carried else None
    span, span_rows, place = (None, None, None) if slot_run is not None else \
        decode_span(list(range(num_seqs)), slots, num_seqs)
    return DeltaPlan(
        slots=slots_t, fresh_slots=fresh_t, fresh_recurrent=fresh_t,  # (every row a decode: the same slots)
        carried_slots=carried_t,
        conv_edge_rows=None, conv_state_index=None, conv_head_index=None, conv_head_valid=None, conv_head_rows=None,
        decode_tokens=torch.arange(num_seqs, device=device), decode_slots=slots_t, decode_span=span,
        decode_span_rows=None if span_rows is None else torch.tensor(span_rows, dtype=torch.int64, device=device),
        decode_place=None if place is None else torch.tensor(place, dtype=torch.int64, device=device),
        groups=[], num_tokens=num_seqs, all_decode=True, slot_run=slot_run)


def plan_delta_step(state: StateBatch, query_start_loc: list[int], kernel: int, device: torch.device,
                    chunk_size: int = CHUNK_SIZE) -> DeltaPlan:
    """Host-side index building for one step (plain ints, then one tensor each)."""
    num_seqs = len(state.slots)
    if num_seqs and query_start_loc == list(range(num_seqs + 1)):
        return plan_decodes(state, device)
    num_tokens = query_start_loc[-1]
    keep = kernel - 1
    edge_rows: list[int] = []  # the conv's edges: cat(saved [num_seqs * keep], x[edge_rows])
    conv_state: list[int] = []
    head_index: list[int] = []
    head_valid: list[int] = []
    head_rows: list[int] = []
    decode_tokens: list[int] = []
    decode_slots: list[int] = []
    # The chunked rule starts fresh prefills from zeros itself (their group's zero_start) and overwrites their
    # states whole: only fresh decode rows (a one-token prompt) need their recurrent state zeroed.
    fresh_recurrent: list[int] = []
    prefills: list[tuple[int, int, int, bool]] = []  # (start, length, slot, fresh)
    for i in range(num_seqs):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        n = end - start
        # the first min(keep, n) new rows: their windows reach into the saved inputs
        heads = min(keep, n)
        first = num_seqs * keep + len(edge_rows)
        edge_rows.extend(range(start, start + heads))
        head_index.extend([*range(i * keep, (i + 1) * keep), *range(first, first + heads)] + [first] * (keep - heads))
        head_valid.extend(range(i * keep, i * keep + heads))
        head_rows.extend(range(start, start + heads))
        if n > keep:  # the state is the last keep new rows
            last = num_seqs * keep + len(edge_rows)
            edge_rows.extend(range(end - keep, end))
            conv_state.extend(range(last, last + keep))
        else:  # the saved inputs after the first n, then the n new rows
            conv_state.extend([*range(i * keep + n, (i + 1) * keep), *range(first, first + n)])
        if n == 1:
            decode_tokens.append(start)
            decode_slots.append(state.slots[i])
            if state.fresh[i]:
                fresh_recurrent.append(state.slots[i])
        elif n > 1:
            prefills.append((start, n, state.slots[i], state.fresh[i]))

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    fresh = [slot for slot, is_fresh in zip(state.slots, state.fresh) if is_fresh]
    carried = [slot for slot, is_fresh in zip(state.slots, state.fresh) if not is_fresh]
    span, span_rows, place = decode_span(decode_tokens, decode_slots, num_tokens) if decode_slots else (None,) * 3
    plan = DeltaPlan(
        slots=tensor(state.slots), fresh_slots=tensor(fresh) if fresh else None,
        carried_slots=tensor(carried) if carried else None,
        fresh_recurrent=tensor(fresh_recurrent) if fresh_recurrent else None,
        conv_edge_rows=tensor(edge_rows), conv_state_index=tensor(conv_state), conv_head_index=tensor(head_index),
        conv_head_valid=tensor(head_valid), conv_head_rows=tensor(head_rows),
        decode_tokens=tensor(decode_tokens) if decode_tokens else None,
        decode_slots=tensor(decode_slots) if decode_slots else None,
        decode_span=span, decode_span_rows=None if span_rows is None else tensor(span_rows),
        decode_place=None if place is None else tensor(place),
        groups=[], num_tokens=num_tokens, all_decode=len(decode_tokens) == num_seqs > 0,
        slot_run=run_start(state.slots))
    if not prefills:
        return plan
    classes: dict[tuple[bool, int], list[tuple[int, int, int, bool]]] = {}
    for p in prefills:  # fresh groups first, each class's sequences longest first
        classes.setdefault((not p[3], prefill_size_class(p[1], chunk_size)), []).append(p)
    for key in sorted(classes):
        # longest first (the rounds' prefixes); equal lengths by slot, so a wave's slots make a run whatever the
        # batch order (a second wave's slots come back in the order the first one's ended)
        group = sorted(classes[key], key=lambda p: (-p[1], p[2]))
        longest = group[0][1]
        # a short prompt needs no chunk padded mostly with zeros: the smallest power of two that holds it
        size = min(chunk_size, 1 << (longest - 1).bit_length())
        num_chunks = [-(-n // size) for _, n, _, _ in group]
        gather: list[int] = []
        pads: list[bool] = []
        tokens: list[int] = []
        positions: list[int] = []
        rounds: list[tuple[int, int]] = []
        for r in range(num_chunks[0]):
            active = sum(1 for c in num_chunks if c > r)
            rounds.append((len(gather) // size, active))
            for start, n, _, _ in group[:active]:
                for t in range(start + r * size, start + min(n, (r + 1) * size)):
                    tokens.append(t)
                    positions.append(len(gather))
                    gather.append(t)
                pad = size - min(size, n - r * size)
                gather.extend([0] * pad)  # any real row: only g and beta must be zero there (gated_delta_rule)
                pads.extend([False] * (size - pad) + [True] * pad)
        order = sorted(range(len(tokens)), key=tokens.__getitem__)  # from_chunks reads back in token order
        slots = [slot for _, _, slot, _ in group]
        plan.groups.append(PrefillGroup(
            slots=tensor(slots), zero_start=not key[0], chunk_size=size, rounds=rounds, chunk_gather=tensor(gather),
            chunk_pads=torch.tensor(pads, device=device).view(-1, 1, size) if any(pads) else None,
            tokens=tensor([tokens[i] for i in order]), positions=tensor([positions[i] for i in order]),
            slot_run=run_start(slots)))
    return plan


# Rows of the prefill conv taken through its taps at a time: 64 rows of Qwen3.5-0.8B's 6,144 channels are 1.5 MiB
# in float32. A 4,096-token step's conv and SiLU took 60 ms a layer as whole-step passes, 38 ms in blocks of 64 rows
# (one thread; two: 43 against 28 ms), 41 / 44 / 55 ms in blocks of 128 / 256 / 512.
CONV_BLOCK_ROWS = 64


def causal_conv(x: torch.Tensor, taps: torch.Tensor, conv_state: torch.Tensor, plan: DeltaPlan) -> torch.Tensor:
    """Depthwise causal conv with SiLU, each sequence continuing from its saved inputs; saves the new ones.

    x: [T, C] new inputs; taps: [K, C] float32 (tap K - 1 multiplies the newest input; rows contiguous, since a
    strided column of the checkpoint's [C, K] made each multiply-add several times slower); conv_state:
    [num_slots, K - 1, C] (read at, then written to, the step's slots; fresh slots are zeroed beforehand; oldest
    input first, each a contiguous row). -> [T, C] float32 (what the delta rule reads).
    The shifted sums run over x's rows as they lie, so a sequence's first K - 1 windows (which reach into its
    saved inputs, or the sequence before it) are redone from its edges (DeltaPlan): no copy of x with each
    sequence's saved inputs laid in front, and no gather of the outputs back out of such a layout (a 4,096-token
    step: 50 MB of bf16 rows and 100 MB of float32 ones a layer).
    A step of decodes only takes delta_decode.decode_conv instead (GatedDeltaNetLayer.decode).
    """
    assert plan.conv_edge_rows is not None, "a step of decodes only takes delta_decode.decode_conv"
    num_seqs, keep = plan.slots.numel(), taps.shape[0] - 1
    num_tokens, channels = x.shape
    run = plan.slot_run
    saved = conv_state[run:run + num_seqs] if run is not None else conv_state.index_select(0, plan.slots)
    edges = torch.cat((saved.reshape(num_seqs * keep, channels).to(x.dtype), x.index_select(0, plan.conv_edge_rows)))
    conv_state.index_copy_(0, plan.slots,
                           edges.index_select(0, plan.conv_state_index).view(num_seqs, keep, -1).to(conv_state.dtype))
    out = torch.empty((num_tokens, channels), dtype=torch.float32, device=x.device)
    # K shifted multiply-adds (no conv1d layout changes) and the SiLU, CONV_BLOCK_ROWS rows at a time: a block's
    # inputs and sums stay in cache through its K + 1 passes, where whole-step passes went to memory each time (off a
    # CPU in one block: there each pass is a kernel launch, and the blocks would multiply them)
    block_rows = CONV_BLOCK_ROWS if x.is_cpu else max(num_tokens, 1)
    for first in range(keep, num_tokens, block_rows):
        n = min(block_rows, num_tokens - first)
        block = x[first - keep:first + n].float()  # [n + K - 1, C]
        sums = torch.mul(block[:n], taps[0], out=out[first:first + n])
        for k in range(1, keep + 1):
            sums.addcmul_(block[k:k + n], taps[k])
        F.silu(sums, inplace=True)
    # each sequence's first K - 1 windows, over (its saved inputs, its first new rows)
    heads = edges.index_select(0, plan.conv_head_index).view(num_seqs, 2 * keep, channels).float()
    sums = torch.mul(heads[:, :keep], taps[0], out=heads.new_empty((num_seqs, keep, channels)))  # [S, K - 1, C]
    for k in range(1, keep + 1):
        sums.addcmul_(heads[:, k:k + keep], taps[k])
    sums = F.silu(sums.view(-1, channels), inplace=True)
    return out.index_copy_(0, plan.conv_head_rows, sums.index_select(0, plan.conv_head_valid))


def exp_normal(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """exp(x) for log decays x <= 0, exactly 0 where it would fall below the dtype's normal range (a subnormal or
    0: under about -86 in float32) and where `keep` (broadcast against x) is False. A new tensor.

    On a CPU torch's vectorised exp leaves its fast path for every lane that underflows (or is -inf): a chunk's
    decays, which span hundreds of e-folds on fast-decaying heads, took 15x longer than over [-80, 0]; and
    subnormal operands slow every multiply and product they reach. The values flushed are under 1.2e-38 in float32.
    """
    floor = math.log(torch.finfo(x.dtype).tiny) + 1.0
    drop = x < floor
    if keep is not None:
        drop.logical_or_(~keep)
    return x.clamp(floor, 0.0).exp_().masked_fill_(drop, 0.0)


def l2_normalize(x: torch.Tensor, scale: torch.Tensor | None = None, inplace: bool = False) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, as flash-linear-attention (and transformers) compute it;
    times `scale` (broadcast against x's [..., 1] norms: a factor per head) when given. inplace: into x (the
    same values), where nothing reads x's old values after. The sums of squares as vector_norm's squares (within
    a few ulps): one pass over x, where x * x then a sum made an x-sized temporary (a 4,096-token step of
    Qwen3.5-0.8B's q and k: 7 against 13 ms a layer)."""
    factor = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().add_(1e-6).rsqrt_()
    factor = factor if scale is None else factor * scale
    return x.mul_(factor) if inplace else x * factor


def fold_scales(recurrent: torch.Tensor, scale: torch.Tensor, plan: DeltaPlan) -> None:
    """Fold the step's slots' scales into their stored states, leaving scale 1: before the chunked rule and the
    mixed step's recurrent_step, which read and write true states. One pass over the carried slots' states (a step
    that carries prefill rows, beside whose products it is small); a fresh slot's state is written whole by the rule
    (a fresh prefill) or was just zeroed (a fresh decode row), so only its scale is reset (a wave of 32 fresh
    prompts: 32 MiB a layer not read and written)."""
    num_seqs = plan.slots.numel()
    carried = plan.carried_slots
    if plan.slot_run is not None and plan.fresh_slots is None:
        rows = slice(plan.slot_run, plan.slot_run + num_seqs)
        recurrent[rows].mul_(scale[rows])
        scale[rows].fill_(1.0)
        return
    if carried is not None:
        pool = recurrent.view(recurrent.shape[0], -1)  # (a 4-D index_select copied rows several times slower)
        states = pool.index_select(0, carried)
        states.view(carried.numel(), recurrent.shape[1], -1).mul_(
            scale.index_select(0, carried).view(carried.numel(), -1, 1))
        pool.index_copy_(0, carried, states)
    if plan.slot_run is not None:
        scale[plan.slot_run:plan.slot_run + num_seqs].fill_(1.0)
    else:
        scale.index_fill_(0, plan.slots, 1.0)


# Per (device, dk): state_reads' index for the largest batch yet, (rows, offsets), and the cuts of it each number of
# (sequence, head) pairs has used (a prefix serves any smaller batch: the bags run pair by pair)
_bag_rows: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor,
                                                dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}


def bag_rows(num_pairs: int, dk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """state_reads' embedding_bag index: int32 rows [num_pairs * 2 * dk], row i of pair p's state at
    [(2 p) dk + i] (q's bag) and [(2 p + 1) dk + i] (k's), as rows of the states viewed [num_pairs * dk, dv]; and
    int32 offsets [num_pairs * 2], a bag every dk. One flat index with its offsets: a 2-D index made
    embedding_bag build the offsets and flatten the index and the weights, three calls a layer."""
    key = (device, dk)
    rows, offsets, cuts = _bag_rows.get(key) or (None, None, {})
    cut = cuts.get(num_pairs)
    if cut is not None:
        return cut
    if rows is None or rows.numel() < num_pairs * 2 * dk:
        pairs = torch.arange(num_pairs, dtype=torch.int32, device=device)
        within = torch.arange(dk, dtype=torch.int32, device=device)
        rows = (pairs.view(-1, 1, 1) * dk + within).expand(-1, 2, dk).reshape(-1)
        offsets = torch.arange(0, rows.numel(), dk, dtype=torch.int32, device=device)
        cuts = {}  # (the cuts of the index replaced go with it)
    cut = cuts[num_pairs] = rows[:num_pairs * 2 * dk], offsets[:num_pairs * 2]
    _bag_rows[key] = rows, offsets, cuts
    return cut


def state_reads(qk: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """q S and k S for each (sequence, head): qk [B, H, 2, dk] against states [B, H, dk, dv] (contiguous) ->
    [B, H, 2, dv] (matmul's values, summed in another order).

    On a CPU as one embedding_bag: each output row is a bag of the state's dk rows weighted by q's (or k's)
    entries, a streaming weighted sum. A batched product makes one small gemm per (sequence, head), [2, dk] x
    [dk, dv], which costs ~10 us even from cache (the packing of a [dk, dv] operand for two rows): 5.3 ms a layer
    at 32 rows on Qwen3.5-0.8B (one thread), the bag 2.5 ms, a plain read of the states 1.1 ms. The bags go pair
    by pair, q's then k's, so k's reads a state just read (a sequence's heads' states, 1 MB on the 0.8B, outgrow a
    core's L2 cache: all q bags first ran 3-20% slower at 32 rows, one noisy run). qk's values are the bags'
    weights, read in place when qk is contiguous (the decode step makes it so: delta_decode.scaled_l2_normalize),
    else copied. Elsewhere the batched product (a GPU's batched gemm has no such per-matrix cost)."""
    if not states.is_cpu:
        return torch.matmul(qk, states)
    batch, heads, _, dk = qk.shape
    dv = states.shape[-1]
    rows, offsets = bag_rows(batch * heads, dk, states.device)
    reads = F.embedding_bag(rows, states.view(-1, dv), offsets, mode="sum", per_sample_weights=qk.reshape(-1))
    return reads.view(batch, heads, 2, dv)


def recurrent_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
    """One token per sequence, in place on `state` [B, H, dk, dv] (float32, contiguous: a view of the pool's
    rows is updated where it lies): decay, delta-rule write, read.

    q, k: [B, H, dk] (normalised, q scaled); v: [B, H, dv]; g, beta: [B, H]. -> [B, H, dv].
    With S the state before the token and d = exp(g), the new state is d S + k delta^T, delta = beta (v - d k S);
    its read is q (d S + k delta^T) = d q S + (q.k) delta. So q S and k S come from one pass over the old state
    (state_reads), and the state is touched by two more passes (the decay, the rank-1 write) where the plain form
    made five, with a state-sized temporary (at 32 rows, 32 MiB a layer)."""
    batch, heads, dk = q.shape
    dv = v.shape[-1]
    read = state_reads(torch.stack((q, k), 2), state)  # [B, H, 2, dv]
    decay = g.exp().unsqueeze(-1)  # [B, H, 1]: one step's decay, far from underflow (exp_normal is for a chunk's sums)
    delta = torch.addcmul(v, decay, read[:, :, 1], value=-1).mul_(beta.unsqueeze(-1))
    out = torch.addcmul(decay * read[:, :, 0], torch.linalg.vecdot(q, k).unsqueeze(-1), delta)
    state.mul_(decay.unsqueeze(-1))
    # the rank-1 write as a broadcast multiply-add: a batched product with an inner size of 1 cost 10-20% more
    state.view(batch * heads, dk, dv).addcmul_(k.reshape(batch * heads, dk, 1), delta.view(batch * heads, 1, dv))
    return out


# At or above this size unit_lower_inverse splits the matrix in halves: fewer sequential row steps.
BLOCKED_INVERSE_SIZE = 32


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for L the strictly lower triangle of `lower` [..., C, C].

    Small sizes by forward substitution one row at a time over the whole batch of chunks and heads: row i of the
    inverse's strict part is -L[i, :i] - L[i, :i] @ X[:i, :i]. torch.linalg.solve_triangular over a batch of
    64 x 64 systems took 430 ms a layer at 512 tokens (0.8B, 2 threads): LAPACK's per-matrix calls; this is C
    small batched products. From BLOCKED_INVERSE_SIZE on, by halves: with A, B the diagonal blocks and C the one
    below them, the inverse is [[A^-1, 0], [-B^-1 C A^-1, B^-1]], A and B inverted as one batch (recursively),
    so a 64 x 64 system takes 15 row steps of its 16 x 16 blocks and four pairs of products, not 63 row steps
    (the row steps, each a small product over the whole batch, were most of its cost)."""
    size = lower.shape[-1]
    if size >= BLOCKED_INVERSE_SIZE and size % 2 == 0:
        half = size // 2
        diagonal = unit_lower_inverse(torch.stack((lower[..., :half, :half], lower[..., half:, half:]), -3))
        upper_inv, lower_inv = diagonal.unbind(-3)  # [..., half, half] each
        inverse = torch.zeros_like(lower)
        inverse[..., :half, :half] = upper_inv
        inverse[..., half:, half:] = lower_inv
        torch.matmul(-(lower_inv @ lower[..., half:, :half]), upper_inv, out=inverse[..., half:, :half])
        return inverse
    inverse = -lower.tril(-1)
    for i in range(1, size):
        row = inverse[..., i:i + 1, :i]  # [..., 1, i], still -L[i, :i]
        row += row @ inverse[..., :i, :i]
    inverse.diagonal(0, -2, -1).fill_(1.0)  # (the row steps never touch the diagonal)
    return inverse


def chunked_rule(states: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, rounds: list[tuple[int, int]], zero_start: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule over whole chunks (WY form: a chunk's writes solved at once from a unit lower
    triangular system, then one state update per chunk), in place on `states` [P, H, dk, dv] float32.

    q, k: [N, H, C, dk] (normalised, q scaled); v: [N, H, C, dv]; g, beta: [N, H, C]; N chunks in the order of
    PrefillGroup.rounds. Pad positions carry g = beta = 0 (q, k, v there may hold any finite values): their row of
    the system is zero, so their written value is zero and they change no state, and causality keeps them out of
    the real positions' outputs.
    Within a chunk, with G the running sum of g and S0 the state before it, the written values U solve
        (I + L) U = beta V - beta exp(G) K S0,   L[i, j] = beta_i exp(G_i - G_j) k_i.k_j  for j < i,
    the outputs are  exp(G_i) q_i S0 + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j,
    and the state after it is  exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T.  -> [N, H, C, dv].
    zero_start: every sequence starts from S0 = 0 (fresh prompts), so `states` is only written: the first round
    skips the read of S0 (its largest product: [2C, dk] x [dk, dv] per chunk and head) and what only that read
    needs (its chunks' solved, decayed k and decayed q: a 128-token prompt's first of two chunks), the decay and
    the adds, and writes its outputs and states straight from two products (the same values: x - 0 and 0 + x
    are x).
    out: where the outputs go ([N, H, C, dv], contiguous), else a new tensor.
    """
    num_chunks, heads, size, dk = k.shape
    dv = v.shape[-1]
    # the first round's chunks start from zeros under zero_start: their reads of S0 are never made
    num_fresh = rounds[0][1] if zero_start and rounds else 0
    cum = g.cumsum(-1)  # [N, H, C]
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = exp_normal(cum.unsqueeze(-1) - cum.unsqueeze(-2), causal)  # [N, H, C, C], 0 above the diagonal
    system = torch.matmul(k, k.transpose(-1, -2)).mul_(decay).mul_(beta.unsqueeze(-1))  # L below the diagonal
    # (I + L)^-1 diag(beta): beta scales the inverse's columns, a [C, C] pass where beta V and beta K were [C, d]
    solve = unit_lower_inverse(system).mul_(beta.unsqueeze(-2))
    # U = written - k_decayed @ S0. Each solved on its own (the inverse is small) and both reads of the chunk's
    # starting state (k_decayed S0 for U, q_decayed S0 for the output) in one buffer, so the scan's single
    # product per round reads them without a concatenated copy, and `written` is contiguous as it comes.
    written = torch.matmul(solve, v)  # [N, H, C, dv]
    cum_exp = exp_normal(cum)
    reads = None  # [N - num_fresh, H, 2C, dk]: the chunks after the fresh ones
    if num_fresh < num_chunks:
        later = slice(num_fresh, None)
        reads = torch.empty((num_chunks - num_fresh, heads, 2 * size, dk), dtype=q.dtype, device=q.device)
        torch.matmul(solve[later] * cum_exp[later].unsqueeze(-2), k[later], out=reads[:, :, :size])
        torch.mul(q[later], cum_exp[later].unsqueeze(-1), out=reads[:, :, size:])
    attn = torch.matmul(q, k.transpose(-1, -2)).mul_(decay)  # [N, H, C, C]
    # [N * H, dk, C] as a transposed view: the products read it transposed in place, no copy
    k_to_end = (k * exp_normal(cum[..., -1:] - cum).unsqueeze(-1)).view(-1, size, dk).transpose(1, 2)
    chunk_decay = cum_exp[..., -1, None, None]  # [N, H, 1, 1]
    out = torch.empty_like(v) if out is None else out
    for first, active in rounds:
        chunk = slice(first, first + active)
        s0 = states[:active]  # a contiguous prefix: updated in place below, no state-sized temporaries
        if first < num_fresh:  # u is `written` itself
            u = written[chunk].view(-1, size, dv)
            torch.bmm(attn[chunk].view(-1, size, size), u, out=out[chunk].view(-1, size, dv))
            torch.bmm(k_to_end[first * heads:(first + active) * heads], u, out=s0.view(-1, dk, dv))
            continue
        read = reads[first - num_fresh:first - num_fresh + active] @ s0  # [active, H, 2C, dv]
        u = written[chunk].sub_(read[:, :, :size]).view(-1, size, dv)  # (written is read nowhere else)
        torch.baddbmm(read[:, :, size:].reshape(-1, size, dv), attn[chunk].view(-1, size, size), u,
                      out=out[chunk].view(-1, size, dv))
        s0.mul_(chunk_decay[chunk])
        s0.view(-1, dk, dv).baddbmm_(k_to_end[first * heads:(first + active) * heads], u)
    return out


def head_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [T, H, d] -> (its storage as rows of d [R, d], the rows between tokens): head h of token t is row
    t * per + h. Heads must be adjacent and each contiguous (a slice of a wider row is: v and q/k come as column
    slices of the conv output), else x is copied first."""
    num_tokens, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or x.stride(0) % d or x.stride(0) < heads * d:
        x = x.contiguous()
    per = x.stride(0) // d
    return x.as_strided(((num_tokens - 1) * per + heads, d), (d, 1)), per


def chunk_rows(group: PrefillGroup, per: int, heads: int) -> torch.Tensor:
    """[num_chunks * heads * chunk_size] rows of head_rows' view laid out as [N, H, C] (cached on the group:
    every layer has the same layout)."""
    key = (per, heads)
    rows = group.gathers.get(key)
    if rows is None:
        tokens = group.chunk_gather.view(-1, 1, group.chunk_size)
        rows = (tokens * per + torch.arange(heads, device=tokens.device).view(1, heads, 1)).view(-1)
        group.gathers[key] = rows
    return rows


def to_chunks(x: torch.Tensor, group: PrefillGroup, chunks: slice = slice(None)) -> torch.Tensor:
    """[T, H, d] -> the group's [N, H, C, d] (or only the chunks `chunks`: one window of the rule), contiguous,
    in one gather (no padded copy of x, no transposing copy after)."""
    flat, per = head_rows(x)
    heads, d = x.shape[1], x.shape[2]
    rows = chunk_rows(group, per, heads).view(-1, heads * group.chunk_size)[chunks].view(-1)
    return flat.index_select(0, rows).view(-1, heads, group.chunk_size, d)


def rule_windows(rounds: list[tuple[int, int]], chunk_size: int, window_tokens: int
                 ) -> list[tuple[slice, list[tuple[int, int]]]]:
    """A group's rounds cut into runs of whole rounds of about `window_tokens` tokens each (0: one run):
    (the run's chunks, its rounds with their first chunk counted from the run's)."""
    windows: list[tuple[slice, list[tuple[int, int]]]] = []
    start, run = 0, []
    for first, active in rounds:
        run.append((first - start, active))
        end = first + active
        if window_tokens and (end - start) * chunk_size >= window_tokens:
            windows.append((slice(start, end), run))
            start, run = end, []
    if run:
        windows.append((slice(start, rounds[-1][0] + rounds[-1][1]), run))
    return windows


def from_chunks(o: torch.Tensor, group: PrefillGroup) -> torch.Tensor:
    """chunked_rule's [N, H, C, dv] -> [len(group.tokens), H, dv], the rows of group.tokens, in one gather."""
    heads, size, dv = o.shape[1], o.shape[2], o.shape[3]
    key = (-1, heads)
    rows = group.gathers.get(key)
    if rows is None:
        position = group.positions.unsqueeze(1)  # [n, 1]
        head = torch.arange(heads, device=position.device).unsqueeze(0)
        rows = ((position // size * heads + head) * size + position % size).view(-1)  # [n * H]
        group.gathers[key] = rows
    return o.view(-1, dv).index_select(0, rows).view(-1, heads, dv)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     recurrent: torch.Tensor, plan: DeltaPlan) -> torch.Tensor:
    """Every sequence's delta rule over its new tokens, from and back into its recurrent state.

    q, k: [T, Hv, dk] float32, normalised, q scaled (key heads already repeated for grouped value heads);
    v: [T, Hv, dv] float32; g (log decay), beta: [T, Hv] float32; recurrent: [num_slots, Hv, dk, dv] float32.
    -> [T, Hv, dv] float32. (A step of decodes only takes delta_decode.decode_rule_at instead:
    GatedDeltaNetLayer.decode; here its rows go the decode_span way like any step's decode rows.)"""
    # [T, H, dv]: each group's rows, then the decode rows, written below; a step of one group's rows only (a wave
    # of new prompts) takes that group's read-back as it comes, in token order (PrefillGroup.tokens)
    whole = len(plan.groups) == 1 and plan.groups[0].tokens.numel() == plan.num_tokens
    out = None if whole else v.new_empty(v.shape)
    # gathers and scatters over [slots, state] rows: a 4-D index_select copied rows several times slower
    pool = recurrent.view(recurrent.shape[0], -1)
    for group in plan.groups:
        gc, bc = (to_chunks(x.unsqueeze(-1), group).squeeze(-1) for x in (g, beta))  # [N, H, C]
        if group.chunk_pads is not None:
            gc.masked_fill_(group.chunk_pads, 0)
            bc.masked_fill_(group.chunk_pads, 0)
        if group.slot_run is not None:  # the pool's own rows, no gather or scatter (32 MiB a layer each at 32 rows)
            states = recurrent[group.slot_run:group.slot_run + group.slots.numel()]
        elif group.zero_start:  # fresh sequences' states are written whole by the rule's first round
            states = recurrent.new_empty((group.slots.numel(), *recurrent.shape[1:]))
        else:
            states = pool.index_select(0, group.slots).view(-1, *recurrent.shape[1:])
        # A window of rounds at a time (RULE_WINDOW_TOKENS): its chunks gathered, solved and scanned, then the next
        # window's from the states it left; the values are the same, the intermediates a window's, not the step's.
        o = v.new_empty((gc.shape[0], *gc.shape[1:], v.shape[-1]))  # [N, H, C, dv]
        for chunks, rounds in rule_windows(group.rounds, group.chunk_size, RULE_WINDOW_TOKENS):
            chunked_rule(states, to_chunks(q, group, chunks), to_chunks(k, group, chunks), to_chunks(v, group, chunks),
                         gc[chunks], bc[chunks], rounds, zero_start=group.zero_start and chunks.start == 0,
                         out=o[chunks])
        if group.slot_run is None:
            pool.index_copy_(0, group.slots, states.view(states.shape[0], -1))
        if whole:
            out = from_chunks(o, group)
        else:
            out.index_copy_(0, group.tokens, from_chunks(o, group))
    if plan.decode_span is not None:  # in place on the run of slots, rows laid out in slot order
        first, count = plan.decode_span

        def laid(x: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [count, ...]; zero rows (an identity) between
            return torch.cat((x, x.new_zeros((1, *x.shape[1:])))).index_select(0, plan.decode_span_rows)

        o = recurrent_step(recurrent[first:first + count], laid(q), laid(k), laid(v), laid(g), laid(beta))
        out[plan.decode_tokens] = o.index_select(0, plan.decode_place)
    elif plan.decode_tokens is not None:
        rows, slots = plan.decode_tokens, plan.decode_slots
        state = pool.index_select(0, slots).view(-1, *recurrent.shape[1:])
        out[rows] = recurrent_step(state, q[rows], k[rows], v[rows], g[rows], beta[rows])
        pool.index_copy_(0, slots, state.view(state.shape[0], -1))
    return out
