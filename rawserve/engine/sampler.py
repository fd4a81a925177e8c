"""Batched sampling over one step's logits: min_tokens, logit_bias, penalties, temperature, min-p, top-k,
top-p, per-request seeded generators, and logprobs of the raw distribution.

Torch ops over [rows, vocab] tensors, never a Python loop over the vocabulary; it decides nothing about stopping.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from rawserve.engine import nucleus, vocab_ops
from rawserve.engine.request import Request
from rawserve.engine.types import FLOAT32_MAX, TokenLogprob

log = logging.getLogger("rawserve.engine.sampler")

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]  # one per row (-1 for a failed row)
    logprobs: list[TokenLogprob | None] | None  # per row (None for rows that did not ask); None if no row did
    # Rows whose sampling raised even alone: row -> the exception. The caller fails those requests alone.
    failed: dict[int, Exception] = field(default_factory=dict)


class SamplingFault(RuntimeError):
    """A row's sampling went wrong without an exception of its own (a token outside the vocabulary)."""


@dataclass(slots=True)
class _Applied:
    """The in-place processors a batch got through before a fault, so that a row retried alone applies each of
    its own exactly once (min_tokens' ban may be applied twice: it only writes -inf)."""
    bias: bool = False  # every row's logit_bias (one op for the batch)
    penalties: set[int] = field(default_factory=set)  # rows whose penalties are in


def token_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[TokenLogprob]:
    """(target, its logprob, its rank, top-N pairs) per row of a log-softmax.

    logprobs: [R, V]; targets: [R] token ids; num_top: N per row. Rank 1 is the most likely token; ties
    share the better rank.
    """
    chosen = logprobs.gather(1, targets.unsqueeze(1))  # [R, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [R] (the sum widens the [R, V] comparison to int64: few rows here)
    k = max(num_top, default=0)
    if k:
        top_values, top_ids = logprobs.topk(k, dim=1)  # [R, k]
        top_values_l, top_ids_l = top_values.tolist(), top_ids.tolist()
    out = []
    for i, (target, value, rank) in enumerate(zip(targets.tolist(), chosen.squeeze(1).tolist(), ranks.tolist())):
        n = num_top[i]
        top = tuple(zip(top_ids_l[i][:n], top_values_l[i][:n])) if n else ()
        out.append((target, value, rank, top))
    return out


def rows_logprobs(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, num_top: list[int]
                  ) -> list[TokenLogprob]:
    """token_logprobs of logits' rows `rows` [R] under their log-softmax, ROW_CHUNK rows at a time: the
    log-softmax and the rank's comparison are [rows, V] temporaries (the rank's widened to int64), which at a
    152k vocabulary would be 1.8 GB for a 1,024-token prompt's prompt_logprobs taken whole."""
    entries: list[TokenLogprob] = []
    for i in range(0, rows.shape[0], vocab_ops.ROW_CHUNK):
        part = slice(i, i + vocab_ops.ROW_CHUNK)
        lp = logits.index_select(0, rows[part]).log_softmax(dim=-1)
        entries += token_logprobs(lp, targets[part], num_top[part])
    return entries


# Candidates a top-p row without top_k takes from its largest logits (through block maxima). When they hold
# more than top_p of the mass (a real model's usual case) the cut lies among them; when not, the row goes to
# nucleus.draw_nucleus, which costs about what a 4,096-candidate probe did (torch.topk over the row).
TOP_P_PROBE = 128
# Candidates a top_k row takes beyond its k, for tokens tied at its k-th value (see Sampler._from_candidates):
# over 256 rows of bf16-rounded logits at 152k, top_k 20: room 1 leaves half the rows to the whole-vocabulary
# sort, 4 leaves 2%, 8 none; the candidates cost 6.4, 6.9, 7.6 ms (32: 12 ms).
TIE_ROOM = 8


class Sampler:
    """Stateless per step, except two per-request things kept across steps: a seeded torch.Generator
    (on the request) and a row of penalty state (token counts), updated with each sampled token so no step
    rebuilds anything from a sequence's full history.

    One pass over each row's vocabulary finds its block maxima (vocab_ops); greedy rows take their argmax
    from them, top-k and top-p rows their largest logits, and temperature, min-p, top-k, top-p and the draw
    work on those few candidates. Top-p rows without top_k that TOP_P_PROBE candidates cannot decide (and
    those with min-p) draw through nucleus.draw_nucleus, which finds the cut without a sort; a top_k row
    whose tie run passes its room sorts its whole vocabulary. The sorts (nucleus.reference for top-p rows
    without top_k) are the reference path, which `fast=False` uses for every row. Rows that keep the whole
    vocabulary (no top_k, no top_p) draw from it in vocabulary order without a sort. Every sampled row
    draws one uniform per token.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0, *,
                 fast: bool = True) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.fast = fast
        # Unseeded requests draw from one engine-wide generator, so an offline run is reproducible.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._counts: torch.Tensor | None = None  # [capacity, V] int32: output token counts per slot
        self._prompt_mask: torch.Tensor | None = None  # [capacity, V] bool: token occurs in the prompt
        self._free_slots: list[int] = []

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Request], *, may_overwrite: bool = False) -> SampleOutput:
        """logits: [len(reqs), V] float32, row i for reqs[i] -> one token per row.

        may_overwrite lets the sampler apply min_tokens, logit_bias and penalties in the caller's tensor
        instead of a copy (EngineCore's logits are fresh each step): at a 150k vocabulary a copy of every row
        is a large part of a CPU step. Temperature and truncation never write to the logits.

        A fault in the batch (an exception, or a token outside the vocabulary) is narrowed down by sampling its
        rows one at a time: the rows that fail alone come back in `failed`, the others with the tokens and
        logprobs the batch would have given them (each row draws the uniform it drew for the batch, and the
        penalty counts change only once a row's sampling is through).
        """
        assert logits.shape[0] == len(reqs), (logits.shape, len(reqs))
        sampled = [i for i, r in enumerate(reqs) if r.params.temperature != 0]
        # Drawn before anything that may fail: a row retried alone draws with the same uniform.
        uniforms = self._uniforms(reqs, sampled) if sampled else None
        wants_logprobs = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        raw_rows = None  # the logprob rows as they came, when processors are about to change them in place
        work = None  # the rows processors may write to; None: every row is plain greedy
        if not all(r.is_plain_greedy for r in reqs):
            work = logits
            if any(r.bias_ids or r.needs_penalties or r.min_tokens_ban for r in reqs):
                if not may_overwrite:
                    work = logits.clone()
                elif wants_logprobs:
                    raw_rows = logits.index_select(0, torch.tensor(wants_logprobs, device=logits.device))
        applied = _Applied()
        try:
            return self._sample_batch(logits, work, raw_rows, reqs, sampled, uniforms, wants_logprobs, applied)
        except Exception as error:  # noqa: BLE001 - one row's values must not fail the batch: rows alone, below
            if len(reqs) == 1:
                return SampleOutput([-1], None, {0: error})
            log.warning("sampling a batch of %d failed (%r); sampling its rows one at a time", len(reqs), error)
        return self._sample_alone(logits, work, raw_rows, reqs, sampled, uniforms, wants_logprobs, applied)

    def _sample_batch(self, logits: torch.Tensor, work: torch.Tensor | None, raw_rows: torch.Tensor | None,
                      reqs: list[Request], sampled: list[int], uniforms: torch.Tensor | None,
                      wants_logprobs: list[int], applied: _Applied) -> SampleOutput:
        penalty_rows = None
        if work is None:
            tokens = vocab_ops.argmax(logits) if self.fast else logits.argmax(dim=-1)  # [B]
        else:
            tokens, penalty_rows = self._sample_general(work, reqs, sampled, uniforms, applied)
        token_ids = tokens.tolist()
        vocab = logits.shape[1]
        if any(not 0 <= t < vocab for t in token_ids):  # never written since the draws fall back; kept as a guard
            raise SamplingFault(f"a row drew a token outside the vocabulary ({vocab}): {token_ids}")
        logprobs = self._logprobs(logits, raw_rows, tokens, reqs, wants_logprobs) if wants_logprobs else None
        if penalty_rows is not None:  # last: a fault before it leaves every row's counts as they were
            slots, rows = penalty_rows
            ones = torch.ones(len(slots), dtype=torch.int32, device=self.device)
            self._counts.index_put_((slots, tokens.index_select(0, rows)), ones, accumulate=True)
        return SampleOutput(token_ids, logprobs)

    def _sample_alone(self, logits: torch.Tensor, work: torch.Tensor | None, raw_rows: torch.Tensor | None,
                      reqs: list[Request], sampled: list[int], uniforms: torch.Tensor | None,
                      wants_logprobs: list[int], applied: _Applied) -> SampleOutput:
        """After a fault in the batch: each row sampled as a batch of one, from the logits as the batch left them
        (`applied` says which of its processors are already in), with the uniform it drew for the batch."""
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        failed: dict[int, Exception] = {}
        for i, req in enumerate(reqs):
            one = slice(i, i + 1)
            row_uniforms = None
            if i in sampled:
                j = sampled.index(i)
                row_uniforms = uniforms[j:j + 1]
            row_raw = None
            if raw_rows is not None and i in wants_logprobs:
                j = wants_logprobs.index(i)
                row_raw = raw_rows[j:j + 1]
            row_applied = _Applied(applied.bias, {0} if i in applied.penalties else set())
            row_work = None if work is None or req.is_plain_greedy else work[one]
            try:
                out = self._sample_batch(logits[one], row_work, row_raw, [req], [0] if row_uniforms is not None else [],
                                         row_uniforms, [0] if i in wants_logprobs else [], row_applied)
            except Exception as error:  # noqa: BLE001 - this row's fault: the caller fails its request alone
                failed[i] = error
                tokens.append(-1)
                continue
            tokens.append(out.token_ids[0])
            if out.logprobs is not None:
                logprobs[i] = out.logprobs[0]
        return SampleOutput(tokens, logprobs if wants_logprobs else None, failed)

    def release(self, req: Request) -> None:
        """Give back a finished request's penalty row."""
        if req.penalty_slot >= 0:
            self._free_slots.append(req.penalty_slot)
            req.penalty_slot = -1

    def _sample_general(self, x: torch.Tensor, reqs: list[Request], sampled: list[int],
                        uniforms: torch.Tensor | None, applied: _Applied
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """x: [B, V] logits; min_tokens, logit_bias and penalties are applied to it in place (those `applied`
        does not hold yet). sampled: the rows with a temperature, uniforms: one per sampled row."""
        dev = self.device

        # Processors in vLLM's order: min_tokens, logit_bias, then penalties; all apply to greedy rows too.
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(reqs):
            if r.min_tokens_ban and r.num_output_tokens < r.params.min_tokens:
                rows.extend([i] * len(r.min_tokens_ban))
                cols.extend(r.min_tokens_ban)
        if rows:
            x[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = _NEG_INF
        rows, cols = [], []
        values: list[float] = []
        for i, r in enumerate(reqs):
            if r.bias_ids:
                rows.extend([i] * len(r.bias_ids))
                cols.extend(r.bias_ids)
                values.extend(r.bias_values)
        if rows and not applied.bias:
            x.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                         torch.tensor(values, dtype=x.dtype, device=dev), accumulate=True)
        applied.bias = True
        penalty_rows = None
        penalized = [i for i, r in enumerate(reqs) if r.needs_penalties]
        if penalized:
            penalty_rows = self._apply_penalties(x, penalized, reqs, applied.penalties)

        if not self.fast:
            tokens = x.argmax(dim=-1)
            if sampled:
                rows_t = torch.tensor(sampled, dtype=torch.int64, device=dev)
                tokens[rows_t] = self._draw_uncovered(x, rows_t, self._options(reqs, sampled), uniforms)
            return tokens, penalty_rows
        maxima = vocab_ops.block_maxima(x)  # [B, ceil(V / BLOCK)]: the one pass over every row
        tokens = vocab_ops.argmax(x, maxima)  # greedy rows' tokens; sampled rows' are written over them
        if sampled:
            self._sample_rows(x, maxima, reqs, sampled, uniforms, tokens)
        return tokens, penalty_rows

    def _uniforms(self, reqs: list[Request], rows: list[int]) -> torch.Tensor:
        """One uniform in [0, 1) per sampled row: a seeded row's from its own generator, so its draws do not
        depend on whatever else is batched; the others' from the engine's."""
        dev = self.device
        uniforms = torch.rand(len(rows), generator=self.generator, device=dev)
        for j, i in enumerate(rows):
            r = reqs[i]
            if r.params.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=dev)
                    r.generator.manual_seed(r.params.seed)
                uniforms[j] = torch.rand((), generator=r.generator, device=dev)
        return uniforms

    def _options(self, reqs: list[Request], rows: list[int]) -> torch.Tensor:
        """[len(rows), 4] float32: temperature, top_k (0: off, else at most V), top_p, min_p."""
        table = torch.tensor([reqs[i].sampling_row for i in rows], dtype=torch.float32, device=self.device)
        table[:, 1].clamp_(max=self.vocab_size)
        return table

    def _sample_rows(self, x: torch.Tensor, maxima: torch.Tensor, reqs: list[Request], sampled: list[int],
                     uniforms: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write a token for each row in `sampled` into tokens, choosing each row's path (see the class)."""
        dev, vocab = self.device, x.shape[1]
        options = self._options(reqs, sampled)  # [S, 4]
        sampled_t = torch.tensor(sampled, dtype=torch.int64, device=dev)
        k_rows = [j for j, i in enumerate(sampled) if reqs[i].params.top_k > 0]
        probe = [j for j, i in enumerate(sampled)
                 if reqs[i].params.top_k == 0 and reqs[i].params.top_p < 1 and reqs[i].params.min_p == 0]
        whole = [j for j, i in enumerate(sampled) if reqs[i].params.top_k == 0 and reqs[i].params.top_p == 1]
        # The rest (no top_k, top_p with min_p) and any candidate row that cannot stand for its vocabulary
        full = sorted(set(range(len(sampled))) - set(k_rows) - set(probe) - set(whole))
        if k_rows:
            full += self._from_candidates(x, maxima, sampled_t, options, uniforms, k_rows, 0, tokens)
        # A probe pays off only well inside the vocabulary: sorting a small one is cheaper than probing it.
        if probe and 32 * TOP_P_PROBE <= vocab:
            probe = self._from_candidates(x, maxima, sampled_t, options, uniforms, probe, TOP_P_PROBE, tokens)
        full += probe
        if whole:
            picked = torch.tensor(whole, dtype=torch.int64, device=dev)
            rows_x = sampled_t.index_select(0, picked)
            tokens[rows_x] = _draw_whole(x, rows_x, options.index_select(0, picked), uniforms.index_select(0, picked),
                                         maxima.index_select(0, rows_x).amax(dim=1))
        if full:
            picked = torch.tensor(sorted(full), dtype=torch.int64, device=dev)
            rows_x = sampled_t.index_select(0, picked)
            tokens[rows_x] = self._draw_uncovered(x, rows_x, options.index_select(0, picked),
                                                  uniforms.index_select(0, picked))

    def _draw_uncovered(self, x: torch.Tensor, rows: torch.Tensor, options: torch.Tensor, uniforms: torch.Tensor
                        ) -> torch.Tensor:
        """Rows no candidate set decides (every sampled row on the reference path) -> [len(rows)] token ids.
        Top-p rows without top_k go to nucleus (which needs no sort on the fast path), the rest, and every row
        of a vocabulary short enough to sort quickly, to the sort."""
        out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
        by_nucleus = (options[:, 1] == 0) & (options[:, 2] < 1) & (x.shape[1] >= nucleus.MIN_VOCAB)
        for which, draw in ((by_nucleus, nucleus.draw_nucleus if self.fast else nucleus.reference),
                            (~by_nucleus, self._sample_sorted)):
            if bool(which.any()):
                out[which] = draw(x, rows[which], options[which], uniforms[which])
        return out

    @staticmethod
    def _from_candidates(x: torch.Tensor, maxima: torch.Tensor, sampled_t: torch.Tensor, options: torch.Tensor,
                         uniforms: torch.Tensor, which: list[int], probe_width: int, tokens: torch.Tensor
                         ) -> list[int]:
        """Draw rows `which` (indices into the sampled rows) from their largest logits: their own top_k when
        probe_width is 0, else probe_width candidates judged by their share of the whole vocabulary's
        probability. Writes the tokens of the rows the candidates decide; returns the others."""
        dev, vocab = x.device, x.shape[1]
        picked = torch.tensor(which, dtype=torch.int64, device=dev)
        opts = options.index_select(0, picked)
        widths = opts[:, 1].long() if not probe_width else torch.full_like(picked, probe_width)
        # A top_k row keeps every token tied at its k-th value, as torch's k-th-value cut does: TIE_ROOM more
        # candidates than the widest row keeps hold the tie runs of bf16 logits (which tie often), and a row
        # whose run reaches the last candidate may go on beyond it, so it goes to the sorted path.
        num = min(int(widths.max()) + (1 if probe_width else TIE_ROOM), vocab)
        rows_x = sampled_t.index_select(0, picked)
        every = len(which) == x.shape[0]  # every row, in order: read x as it is
        values, ids = vocab_ops.topk(x, num, maxima, None if every else rows_x)  # [C, num], largest first
        if not probe_width:
            last = values.gather(1, (widths - 1).unsqueeze(1))  # [C, 1]: the k-th value
            finite = last.squeeze(1).isfinite()  # -inf ties carry no weight: nothing to keep
            tied = (values >= last).sum(dim=1)  # [C]: k, and the ties at the k-th value after it
            widths = torch.where(finite, tied, widths)
            tie_covered = (tied < num) | (num == vocab) | ~finite
        # values[:, 0], the row's largest logit, is where the tempered row is shifted to 0 (see _truncate_and_draw)
        whole = vocab_ops.probs_at(x, rows_x, opts[:, 0], ids, values[:, 0]) if probe_width else None
        where, covered = _truncate_and_draw(values, widths, opts, whole, uniforms.index_select(0, picked))
        if not probe_width:
            covered = tie_covered
        chosen = ids.gather(1, where.unsqueeze(1)).squeeze(1)
        tokens[rows_x[covered]] = chosen[covered]
        return [j for j, ok in zip(which, covered.tolist()) if not ok]

    @staticmethod
    def _sample_sorted(x: torch.Tensor, rows: torch.Tensor, options: torch.Tensor, uniforms: torch.Tensor
                       ) -> torch.Tensor:
        """The reference path: each row's whole vocabulary sorted, in row chunks. A top_k row keeps the ties at
        its k-th value as torch's masking did. -> [len(rows)] token ids."""
        out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
        for start in range(0, rows.shape[0], vocab_ops.ROW_CHUNK):
            end = start + vocab_ops.ROW_CHUNK
            opts = options[start:end]
            # Stable: equal values in token-id order, as vocab_ops.topk gives candidates, so a draw picks the same
            # token on either path.
            values, ids = x.index_select(0, rows[start:end]).sort(dim=1, descending=True, stable=True)  # [R, V]
            k = opts[:, 1].long()
            widths = torch.full_like(k, values.shape[1])
            if bool((k > 0).any()):
                kth = values.gather(1, (k - 1).clamp_min(0).unsqueeze(1))  # [R, 1]
                widths = torch.where(k > 0, (values >= kth).sum(dim=1), widths)
            where, _ = _truncate_and_draw(values, widths, opts, None, uniforms[start:end])
            out[start:end] = ids.gather(1, where.unsqueeze(1)).squeeze(1)
        return out

    def _apply_penalties(self, x: torch.Tensor, rows: list[int], reqs: list[Request], done: set[int]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Repetition (HF: over prompt and output, divide positive logits, multiply negative ones), then
        frequency and presence (OpenAI: over generated tokens only, subtracted). Rows in `done` already have
        them; each row is added to it once its penalties are in. -> (slots, rows) of every row in `rows`."""
        dev = self.device
        slots = torch.tensor([self._slot(reqs[i]) for i in rows], dtype=torch.int64, device=dev)  # [P]
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)  # [P]
        todo = [j for j, i in enumerate(rows) if i not in done]  # positions in `rows`
        if not todo:
            return slots, rows_t
        todo_t = torch.tensor(todo, dtype=torch.int64, device=dev)
        todo_slots, todo_rows = slots.index_select(0, todo_t), rows_t.index_select(0, todo_t)
        factors = torch.tensor([(reqs[rows[j]].params.repetition_penalty, reqs[rows[j]].params.frequency_penalty,
                                 reqs[rows[j]].params.presence_penalty) for j in todo],
                               dtype=torch.float32, device=dev)  # [T, 3]
        # In row chunks: each pass makes [rows, V] temporaries (float, int32 and bool), about six of them.
        for i in range(0, len(todo), vocab_ops.ROW_CHUNK):
            part = slice(i, i + vocab_ops.ROW_CHUNK)
            repetition, frequency, presence = (f.unsqueeze(1) for f in factors[part].unbind(dim=1))  # each [p, 1]
            counts = self._counts.index_select(0, todo_slots[part])  # [p, V]
            seen = counts > 0
            sub = x.index_select(0, todo_rows[part])  # [p, V]
            occurred = seen | self._prompt_mask.index_select(0, todo_slots[part])
            # A small penalty divides a logit past float32's range: held at its largest, never inf (inf - inf
            # is NaN once the temperature's shift subtracts the row's max)
            sub = torch.where(occurred, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
            sub = (sub - frequency * counts - presence * seen).clamp_(max=FLOAT32_MAX)
            x.index_copy_(0, todo_rows[part], sub)
            done.update(rows[j] for j in todo[part])
        return slots, rows_t

    def _slot(self, req: Request) -> int:
        """The request's penalty row, built from its tokens once (on first use), then kept incrementally."""
        if req.penalty_slot >= 0:
            return req.penalty_slot
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        counts, mask = self._counts[slot], self._prompt_mask[slot]
        counts.zero_()
        mask.zero_()
        prompt = req.token_ids[:req.num_prompt_tokens]
        mask[torch.tensor(prompt, dtype=torch.int64, device=self.device)] = True
        outputs = req.token_ids[req.num_prompt_tokens:]
        if outputs:
            ids = torch.tensor(outputs, dtype=torch.int64, device=self.device)
            counts.index_add_(0, ids, torch.ones(len(outputs), dtype=torch.int32, device=self.device))
        req.penalty_slot = slot
        return slot

    def _grow(self) -> None:
        old = 0 if self._counts is None else self._counts.shape[0]
        capacity = max(8, 2 * old)
        counts = torch.zeros((capacity, self.vocab_size), dtype=torch.int32, device=self.device)
        mask = torch.zeros((capacity, self.vocab_size), dtype=torch.bool, device=self.device)
        if old:
            counts[:old] = self._counts
            mask[:old] = self._prompt_mask
        self._counts, self._prompt_mask = counts, mask
        self._free_slots.extend(range(capacity - 1, old - 1, -1))

    @staticmethod
    def _logprobs(logits: torch.Tensor, raw_rows: torch.Tensor | None, tokens: torch.Tensor, reqs: list[Request],
                  rows: list[int]) -> list[TokenLogprob | None]:
        """From the raw log-softmax: before logit_bias, penalties, temperature and truncation. raw_rows: the
        rows' logits as they came, when the processors have since changed `logits` in place."""
        rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        num_top = [reqs[i].params.logprobs for i in rows]
        targets = tokens.index_select(0, rows_t)
        source, picked = (logits, rows_t) if raw_rows is None else \
            (raw_rows, torch.arange(len(rows), device=logits.device))  # raw_rows holds just these rows, in order
        entries = rows_logprobs(source, picked, targets, num_top)
        out: list[TokenLogprob | None] = [None] * len(reqs)
        for i, entry in zip(rows, entries):
            out[i] = entry
        return out


def _truncate_and_draw(values: torch.Tensor, widths: torch.Tensor, options: torch.Tensor, whole: torch.Tensor | None,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, min-p, top-k and top-p over each row's candidates, then one draw.

    values: [R, N] logits, largest first; widths: [R] leading candidates a row may keep (its top_k, or all it
    has); options: [R, 4] as Sampler._options; whole: [R, N] the candidates' probabilities under the row's
    whole tempered vocabulary (top-p probe rows), or None when the candidates hold all a row can keep.
    Returns each row's drawn column [R], and whether the candidates decided its top-p cut [R] (always, without
    `whole`).
    Softmax rather than exp throughout: see vocab_ops.probs_at.
    """
    temperature, top_p, min_p = options[:, 0:1], options[:, 2:3], options[:, 3:4]  # each [R, 1]
    num = values.shape[1]
    # Shifted so the largest is 0 before dividing: values / a small temperature overflow to inf (a temperature
    # of 1e-37 and a logit of 10), and softmax then takes inf - inf = NaN. Shifted, every value is <= 0.
    z = (values - values[:, :1]) / temperature  # [R, N]
    # Each pass below runs only when some row needs it: on a sorted whole vocabulary each is a full pass.
    if int(widths.min()) < num:
        z.masked_fill_(torch.arange(num, device=values.device) >= widths.unsqueeze(1), _NEG_INF)
    if bool((min_p > 0).any()):
        # min-p: p_i < min_p * p_max is z_i < z_max + log(min_p), no softmax needed; log(0) = -inf keeps all.
        z.masked_fill_(z < z[:, :1] + min_p.log(), _NEG_INF)
    weights = z.softmax(dim=1)  # [R, N]: over the kept candidates, 0 for what is cut
    covered = torch.ones(values.shape[0], dtype=torch.bool, device=values.device)
    if bool((top_p < 1).any()):
        # Each candidate's probability: over the kept candidates, or over the whole vocabulary (probe rows).
        probs = weights if whole is None else whole.masked_fill(z == _NEG_INF, 0.0)
        cumulative = probs.cumsum(dim=1)
        # Keep the smallest set of most likely tokens whose mass reaches p (the most likely always stays).
        weights = weights.masked_fill((cumulative - probs > top_p) & (top_p < 1), 0.0)
        if whole is not None:
            covered = (cumulative[:, -1] > top_p.squeeze(1)) | (top_p.squeeze(1) >= 1)
    return vocab_ops.draw(weights, uniforms), covered


def _draw_whole(x: torch.Tensor, rows: torch.Tensor, options: torch.Tensor, uniforms: torch.Tensor,
                row_max: torch.Tensor) -> torch.Tensor:
    """Rows with neither top_k nor top_p keep their whole vocabulary (less min-p's cut): a draw in vocabulary
    order needs no sort. row_max: [len(rows)] each row's largest logit (the shift, as in _truncate_and_draw).
    In row chunks; -> [len(rows)] token ids."""
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
    for start in range(0, rows.shape[0], vocab_ops.ROW_CHUNK):
        end = start + vocab_ops.ROW_CHUNK
        opts = options[start:end]
        shifted = x.index_select(0, rows[start:end]).sub_(row_max[start:end].unsqueeze(1))
        weights = shifted.div_(opts[:, 0:1]).softmax(dim=1)  # [R, V]
        if bool((opts[:, 3] > 0).any()):  # min-p
            weights.masked_fill_(weights < weights.amax(dim=1, keepdim=True) * opts[:, 3:4], 0.0)
        out[start:end] = vocab_ops.draw(weights, uniforms[start:end])
    return out
