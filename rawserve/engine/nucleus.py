"""Top-p (with min-p) over whole rows without sorting them, for the sampler's rows without top_k whose nucleus
its candidates cannot hold (a flat row: temperature 1, top_p 0.9 over 152k tokens keeps most of them).
Draws only: the options come decided from the sampler.
"""
from __future__ import annotations

import math

import torch

from rawserve.engine import vocab_ops

# Vocabularies from this size on take this path; below it a sort is cheaper (64 flat rows: 8 against 5 ms at
# 1,024 tokens, 10 against 20 at 4,096, 58 against 464 at 152k).
MIN_VOCAB = 4096
# Slices of tempered logit per row: a Gaussian row of 152k tokens puts about 130 tokens in the fullest slice.
BUCKETS = 4096
# Logits further than this below a row's max share the last slice (each weighs under e^-40 of the max).
SPAN = 40.0


def reference(x: torch.Tensor, rows: torch.Tensor, options: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The definition, by a whole-row sort. x: [B, V] logits; rows [R] of them, options [R, 4] (temperature,
    top_k (unused: 0 for these rows), top_p, min_p), uniforms [R] in [0, 1) -> [R] token ids.

    Each row's tokens sorted by logit (equal logits in token-id order), kept while the mass before them is at
    most top_p of the row's, and one uniform drawn by inverse CDF in that order. Masses add in float64, so the
    cut and the draw are exact to far below one token's share of a row (a float32 running sum over 150k tokens
    drifts by more than that)."""
    out = []
    for i, row in enumerate(rows.tolist()):
        probs = _tempered(x[row:row + 1], options[i:i + 1])[1][0]
        ids = x[row].sort(descending=True, stable=True).indices
        p = probs.index_select(0, ids).double()
        running = p.cumsum(dim=0)
        kept = _exclusive(running, 0.0) <= float(options[i, 2]) * float(running[-1])
        if not bool(kept.any()):  # a NaN row
            out.append(int(x[row].argmax()))
            continue
        out.append(int(ids[_pick(running, _target(float(uniforms[i]), float(running[kept][-1])))]))
    return torch.tensor(out, dtype=torch.int64, device=x.device)


def draw_nucleus(x: torch.Tensor, rows: torch.Tensor, options: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`reference`'s tokens, in row chunks of vocab_ops.ROW_CHUNK, without a sort of any whole row.

    Each row's tempered logits below its max are cut into BUCKETS equal slices (a larger logit never falls in a
    later slice, so the slices are ordered as the sorted tokens are); one pass adds each token's probability
    into its slice. The running mass over the slices names the slice holding the top-p cut and the slice
    holding the draw, and only those slices' tokens are sorted. At 152k tokens a row costs an eighth of a
    sort (0.9 against 7 ms on 2 cores)."""
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
    for start in range(0, rows.shape[0], vocab_ops.ROW_CHUNK):
        end = start + vocab_ops.ROW_CHUNK
        out[start:end] = _draw_chunk(x.index_select(0, rows[start:end]), options[start:end], uniforms[start:end])
    return out


def _tempered(raw: torch.Tensor, options: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> [R, V] logits over each row's temperature, and their probabilities after min-p's cut (as the sorted
    path: min-p first, top-p over what it keeps). Softmax keeps a row on one thread (see vocab_ops.probs_at).
    Shifted so each row's largest is 0 before the division, as the sampler's candidates are: a small temperature
    would otherwise overflow logits to inf, and inf - inf is NaN."""
    z = (raw - raw.amax(dim=1, keepdim=True)).div_(options[:, 0:1])
    min_p = options[:, 3:4]
    kept = z
    if bool((min_p > 0).any()):
        kept = z.masked_fill(z < z.amax(dim=1, keepdim=True) + min_p.log(), float("-inf"))
    return z, kept.softmax(dim=1)


def _target(uniform: float, total: float) -> float:
    """Where a uniform in [0, 1) lands on a running mass ending at `total`: uniform * total, kept below the total
    (it may round up to it), as vocab_ops.draw keeps it."""
    return min(uniform * total, math.nextafter(total, 0.0))


def _pick(running: torch.Tensor, target: float) -> int:
    """Inverse CDF: the first position whose float64 running mass passes `target`, clamped to the last."""
    where = int(torch.searchsorted(running, torch.tensor([target], dtype=torch.float64), right=True))
    return min(where, running.shape[0] - 1)


def _draw_chunk(raw: torch.Tensor, options: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    num_rows = raw.shape[0]
    z, probs = _tempered(raw, options)  # [R, V] each
    # Slice = how far below the row's max, in steps of span / BUCKETS: slice 0 holds the max.
    z_max = z.amax(dim=1, keepdim=True)
    span = (z_max - z.amin(dim=1, keepdim=True)).clamp_(max=SPAN)
    scale = torch.where(span > 0, BUCKETS / span, torch.zeros_like(span))
    # Each row's slices offset by row * BUCKETS, so one flat index_add_ sums them all; NaN (a broken model)
    # lands in the row's last slice, never out of range. min-p's cut tokens keep their slice, with weight 0.
    offsets = torch.arange(num_rows, device=raw.device, dtype=torch.float32).mul_(BUCKETS).unsqueeze(1)
    slices = z.sub_(z_max).neg_().mul_(scale).clamp_(0, BUCKETS - 1).nan_to_num_(BUCKETS - 1).add_(offsets).int()
    mass = torch.zeros(num_rows * BUCKETS, dtype=torch.float64, device=raw.device)
    mass.index_add_(0, slices.view(-1), probs.view(-1).double())
    running = mass.view(num_rows, BUCKETS).cumsum(dim=1)  # [R, BUCKETS]: the mass of slices 0..j
    cut = options[:, 2].double() * running[:, -1]  # [R]: keep a token while the mass before it is <= cut
    cut_at = (running <= cut.unsqueeze(1)).sum(dim=1).clamp_(max=BUCKETS - 1)  # the first slice past the cut
    cut_ids = _sorted_slices(raw, slices, cut_at)
    totals, found = [], []
    for i, ids in enumerate(cut_ids):
        before = _before(running[i], int(cut_at[i]))
        run = probs[i].index_select(0, ids).double().cumsum(dim=0).add_(before)
        kept = _exclusive(run, before) <= float(cut[i])  # the first is kept: the slices before it pass no cut
        found.append(bool(kept.any()))  # all but a NaN row, whose masses never compare
        totals.append(float(run[kept][-1]) if found[-1] else 1.0)
    targets = [_target(u, total) for u, total in zip(uniforms.tolist(), totals)]
    draw_at = (running <= torch.tensor(targets, dtype=torch.float64, device=raw.device).unsqueeze(1)).sum(dim=1)
    draw_ids = _sorted_slices(raw, slices, draw_at.clamp_(max=BUCKETS - 1))
    out = []
    for i, ids in enumerate(draw_ids):
        if not found[i] or not ids.shape[0]:
            out.append(int(raw[i].argmax()))  # NaN counts as the largest, as greedy's argmax
            continue
        run = probs[i].index_select(0, ids).double().cumsum(dim=0).add_(_before(running[i], int(draw_at[i])))
        out.append(int(ids[_pick(run, targets[i])]))
    return torch.tensor(out, dtype=torch.int64, device=raw.device)


def _exclusive(running: torch.Tensor, start: float) -> torch.Tensor:
    """A running mass [n] that began at `start` -> the mass before each position (the first's is `start`)."""
    return torch.cat((running.new_full((1,), start), running[:-1]))


def _before(running: torch.Tensor, at: int) -> float:
    """The mass of a row's slices before slice `at`."""
    return float(running[at - 1]) if at > 0 else 0.0


def _sorted_slices(raw: torch.Tensor, slices: torch.Tensor, at: torch.Tensor) -> list[torch.Tensor]:
    """Each row's tokens in its slice at[row] (slices carry the row offsets), sorted as the whole row would
    be: logit descending, equal logits by id -> one id tensor per row. One pass finds them all."""
    num_rows = raw.shape[0]
    wanted = at.to(torch.int32) + torch.arange(num_rows, dtype=torch.int32, device=raw.device) * BUCKETS
    where = (slices == wanted.unsqueeze(1)).nonzero()  # [n, 2]: (row, id), rows ascending, ids ascending
    counts = torch.bincount(where[:, 0], minlength=num_rows).tolist()
    out = []
    for row, ids in enumerate(where[:, 1].split(counts)):
        order = raw[row].index_select(0, ids).sort(descending=True, stable=True).indices  # stable: ids ascending
        out.append(ids.index_select(0, order))
    return out
