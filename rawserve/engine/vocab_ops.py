"""Row-wise reductions over [rows, vocab] logits that read each row once and allocate nothing vocabulary-wide.

The sampler's building blocks: argmax and exact top-k through block maxima, candidates' probabilities under
the whole row in row chunks, and one-uniform inverse-CDF draws. They decide nothing about sampling options.
"""
from __future__ import annotations

import torch

# Vocabulary positions per block. torch's argmax and topk over a 152k row are scalar loops (about 5x a
# vectorised amax); a row's block maxima cost one vectorised pass, and the winner is then found inside
# a few blocks. 128 keeps the maxima ([rows, V / 128]) small and the gathered blocks cheap.
BLOCK = 128
# Rows per chunk for passes that need a float temporary as wide as the row: a [256, 152k] temporary is
# 155 MB, which glibc maps fresh (and the kernel zero-fills) on every step; a few rows stay in the heap. 8, not 16:
# the sorted path and the penalties hold five or six such temporaries at once (bench.step_memory at 32 x 152k rows:
# top-p with min-p and logprobs 126-172 MiB at 16 rows, 70-98 at 8; penalties with logprobs 130, 88).
ROW_CHUNK = 8


def block_maxima(x: torch.Tensor) -> torch.Tensor:
    """x: [R, V] -> [R, ceil(V / BLOCK)], block j's max over positions [j * BLOCK, (j + 1) * BLOCK)."""
    rows, vocab = x.shape
    full = vocab // BLOCK
    parts = []
    if full:
        parts.append(x.as_strided((rows, full, BLOCK), (x.stride(0), BLOCK, 1)).amax(dim=2))  # [R, full]
    if vocab % BLOCK:
        parts.append(x[:, full * BLOCK:].amax(dim=1, keepdim=True))  # [R, 1]: the short last block
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _read_blocks(x: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Blocks [R, n] of x's rows `rows` (all when None) -> their values [R, n * BLOCK], block by block: whole
    blocks copied through a [rows, blocks, BLOCK] view, never whole rows. The short last block reads -inf past
    the vocabulary's end, so padding never wins."""
    num_rows, vocab = x.shape
    full = vocab // BLOCK
    if rows is None:
        rows = torch.arange(num_rows, device=x.device)
    rows = rows.unsqueeze(1)  # [R, 1]
    if not full:  # a vocabulary shorter than a block: its one block is the short one
        values = x.new_full((rows.shape[0], blocks.shape[1], BLOCK), float("-inf"))
        values[:, :, :vocab] = x[rows.squeeze(1)].unsqueeze(1)
        return values.flatten(1)
    if vocab % BLOCK == 0 and x.is_contiguous():
        # Rows of blocks of a [rows * blocks, BLOCK] view: index_select copies each block whole (about 15x
        # faster than indexing the 3-d view, which computes an offset per element)
        flat = (rows * full + blocks).flatten()  # [R * n]
        return x.view(-1, BLOCK).index_select(0, flat).view(rows.shape[0], -1)
    view = x.as_strided((num_rows, full, BLOCK), (x.stride(0), BLOCK, 1))
    values = view[rows, blocks.clamp_max(full - 1)]  # [R, n, BLOCK]
    if vocab % BLOCK:
        short = blocks == full  # [R, n]
        if bool(short.any()):
            tail = x.new_full((rows.shape[0], BLOCK), float("-inf"))
            tail[:, :vocab - full * BLOCK] = x[rows.squeeze(1), full * BLOCK:]
            values[short] = tail.unsqueeze(1).expand_as(values)[short]
    return values.flatten(1)


def _ids(blocks: torch.Tensor, where: torch.Tensor, vocab: int) -> torch.Tensor:
    """Positions in _read_blocks' values [R, m] -> token ids [R, m] (padding clamped to the last id)."""
    return (blocks.gather(1, where // BLOCK) * BLOCK + where % BLOCK).clamp_max_(vocab - 1)


def argmax(x: torch.Tensor, maxima: torch.Tensor | None = None) -> torch.Tensor:
    """x.argmax(dim=1), the same index (the first of equal maxima, NaN counting as the largest), in one
    vectorised pass: the first block holding the row's max, then the first max inside it. maxima: x's
    block_maxima when the caller has them."""
    if maxima is None:
        maxima = block_maxima(x)
    blocks = maxima.argmax(dim=1, keepdim=True)  # [R, 1]
    values = _read_blocks(x, blocks, None)  # [R, BLOCK]
    return _ids(blocks, values.argmax(dim=1, keepdim=True), x.shape[1]).squeeze(1)  # [R]


def topk(x: torch.Tensor, k: int, maxima: torch.Tensor, rows: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x[rows].topk(k, dim=1) (sorted, largest first) through x's block maxima (all of x's rows): exact,
    since a value above the k-th largest lies in a block whose max is too, and at most k - 1 blocks can
    have one. Equal values come in token-id order (ties_by_id); which of several equal values at the k-th place
    is returned may differ from torch.topk's choice."""
    if rows is not None:
        maxima = maxima.index_select(0, rows)
    if k * BLOCK * 2 >= x.shape[1]:  # the blocks would cover most of the row anyway
        return ties_by_id(*(x if rows is None else x.index_select(0, rows)).topk(k, dim=1))
    blocks = maxima.topk(k, dim=1).indices  # [R, k]
    top_values, where = _read_blocks(x, blocks, rows).topk(k, dim=1)  # [R, k]
    return ties_by_id(top_values, _ids(blocks, where, x.shape[1]))


def ties_by_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates [R, N] largest first -> the same, equal values ordered by token id, as a stable sort of the
    whole row orders them: a draw then picks the same token from either. Free when no two values are equal
    (float32 logits); bf16 logits tie often."""
    if values.shape[1] < 2 or not bool((values[:, 1:] == values[:, :-1]).any()):
        return values, ids
    ids, order = ids.sort(dim=1)
    values, order = values.gather(1, order).sort(dim=1, descending=True, stable=True)
    return values, ids.gather(1, order)


def probs_at(x: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor,
             shift: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities of tokens `ids` [R, N] under softmax((x[row] - shift) / scale) over the whole row, for x's
    rows `rows` [R], divisors `scale` [R] and each row's largest logit `shift` [R] (subtracted first, so a small
    divisor cannot overflow a logit to inf; found here when None); in row chunks (ROW_CHUNK). Through softmax, not
    exp or logsumexp: with two threads on a busy CPU those fan a single row out to OpenMP threads and stall for a scheduler
    tick (16 ms measured, even at 2,048 entries), while softmax keeps a row on one thread."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=x.device)
    for start in range(0, rows.shape[0], ROW_CHUNK):
        end = start + ROW_CHUNK
        row = x.index_select(0, rows[start:end])
        row.sub_(row.amax(dim=1, keepdim=True) if shift is None else shift[start:end].unsqueeze(1))
        row_probs = row.div_(scale[start:end].unsqueeze(1)).softmax(dim=1)
        out[start:end] = row_probs.gather(1, ids[start:end])
    return out


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one uniform in [0, 1) per row: weights [R, N] >= 0 (not normalised) -> [R] column
    indices, each drawn with probability weights / row sum. A column of weight 0 is never drawn, but in a row
    with no positive finite total (NaN weights from NaN logits, or nothing kept), which takes its largest weight
    (NaN counting as the largest, as argmax does): always a column inside the row."""
    cumulative = weights.cumsum(dim=1)  # not cumsum_: torch's in-place form runs several times slower
    totals = cumulative[:, -1]
    # u < 1, but u * total may round up to the total: stay strictly below it, so some column passes
    targets = torch.minimum(uniforms * totals, torch.nextafter(totals, torch.zeros_like(totals))).unsqueeze(1)
    # The first column whose running sum passes the target; a zero-weight column repeats the sum before it,
    # so it is never the first to pass.
    where = torch.searchsorted(cumulative, targets, right=True).squeeze(1)
    # A NaN total passes no target: searchsorted says N, one past the row (issue 33's "index 2048 is out of
    # bounds for dimension 1 with size 2048", which failed the step for every request)
    broken = ~(totals > 0) | totals.isinf()
    if bool(broken.any()):
        where[broken] = weights[broken].argmax(dim=1)
    return where
