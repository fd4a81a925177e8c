"""Batched sampling over one step's logits: min_tokens, logit_bias, penalties, temperature, min-p, top-k,
top-p, per-request seeded generators, and logprobs of the raw distribution.

Torch ops over [rows, vocab] tensors, never a Python loop over the vocabulary; it decides nothing about stopping.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rawserve.engine.request import Request
from rawserve.engine.types import TokenLogprob

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None] | None  # per row (None for rows that did not ask); None if no row did


def token_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[TokenLogprob]:
    """(target, its logprob, its rank, top-N pairs) per row of a log-softmax.

    logprobs: [R, V]; targets: [R] token ids; num_top: N per row. Rank 1 is the most likely token; ties
    share the better rank.
    """
    chosen = logprobs.gather(1, targets.unsqueeze(1))  # [R, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [R]
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


class Sampler:
    """Stateless per step, except two per-request things kept across steps: a seeded torch.Generator
    (on the request) and a row of penalty state (token counts), updated with each sampled token so no step
    rebuilds anything from a sequence's full history."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Unseeded requests draw from one engine-wide generator, so an offline run is reproducible.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._counts: torch.Tensor | None = None  # [capacity, V] int32: output token counts per slot
        self._prompt_mask: torch.Tensor | None = None  # [capacity, V] bool: token occurs in the prompt
        self._free_slots: list[int] = []

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Request], *, may_overwrite: bool = False) -> SampleOutput:
        """logits: [len(reqs), V] float32, row i for reqs[i] -> one token per row.

        may_overwrite lets the sampler work in the caller's tensor instead of a copy (EngineCore's logits
        are fresh each step): at a 150k vocabulary the copy is a large part of a CPU step.
        """
        assert logits.shape[0] == len(reqs), (logits.shape, len(reqs))
        wants_logprobs = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        penalty_rows = None
        if all(r.is_plain_greedy for r in reqs):
            tokens = logits.argmax(dim=-1)  # [B]
        else:
            # The raw logits stay untouched when logprobs will be read from them.
            work = logits if may_overwrite and not wants_logprobs else logits.clone()
            tokens, penalty_rows = self._sample_general(work, reqs)
        if penalty_rows is not None:
            slots, rows = penalty_rows
            ones = torch.ones(len(slots), dtype=torch.int32, device=self.device)
            self._counts.index_put_((slots, tokens.index_select(0, rows)), ones, accumulate=True)
        logprobs = self._logprobs(logits, tokens, reqs, wants_logprobs) if wants_logprobs else None
        return SampleOutput(tokens.tolist(), logprobs)

    def release(self, req: Request) -> None:
        """Give back a finished request's penalty row."""
        if req.penalty_slot >= 0:
            self._free_slots.append(req.penalty_slot)
            req.penalty_slot = -1

    def _sample_general(self, x: torch.Tensor, reqs: list[Request]
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """x: [B, V] logits, modified in place."""
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
        if rows:
            x.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                         torch.tensor(values, dtype=x.dtype, device=dev), accumulate=True)
        penalty_rows = None
        penalized = [i for i, r in enumerate(reqs) if r.needs_penalties]
        if penalized:
            penalty_rows = self._apply_penalties(x, penalized, reqs)

        greedy = [r.params.temperature == 0 for r in reqs]
        argmax = x.argmax(dim=-1)  # [B]
        if all(greedy):
            return argmax, penalty_rows

        table = torch.tensor([r.sampling_row for r in reqs], dtype=torch.float32, device=dev)  # [B, 4]
        temperature, top_k, top_p, min_p = table.unbind(dim=1)  # each [B]
        x.div_(temperature.unsqueeze(1))
        if any(r.params.min_p > 0 for r in reqs):
            probs = x.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
            x.masked_fill_(probs < threshold, _NEG_INF)
        if any(r.params.top_k > 0 for r in reqs):
            self._top_k(x, top_k)
        if any(r.params.top_p < 1 for r in reqs):
            self._top_p(x, top_p)
        probs = x.softmax(dim=-1)  # [B, V]

        # Exponential race (argmax p/q with q ~ Exp(1)) is a draw from p. A seeded row fills its own q
        # from its own generator, V draws per token, so its samples ignore whatever else is batched.
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.params.seed is not None and not greedy[i]:
                if r.generator is None:
                    r.generator = torch.Generator(device=dev)
                    r.generator.manual_seed(r.params.seed)
                q[i].exponential_(generator=r.generator)
        q.clamp_min_(torch.finfo(q.dtype).tiny)  # 0 would turn a zero-probability token into 0/0
        sampled = (probs / q).argmax(dim=-1)  # [B]
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=dev), argmax, sampled)
        return sampled, penalty_rows

    @staticmethod
    def _top_k(x: torch.Tensor, top_k: torch.Tensor) -> None:
        """Keep each row's k largest logits (ties at the k-th value stay); k == 0 keeps all."""
        k = top_k.long().clamp(0, x.shape[1])  # [B]
        active = k > 0
        k = torch.where(active, k, torch.ones_like(k))
        max_k = int(k.max())
        kth = x.topk(max_k, dim=1).values.gather(1, (k - 1).unsqueeze(1))  # [B, 1]: the k-th largest
        kth.masked_fill_(~active.unsqueeze(1), _NEG_INF)
        x.masked_fill_(x < kth, _NEG_INF)

    @staticmethod
    def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> None:
        """Keep the smallest set of most likely tokens whose mass reaches p (the most likely always stays)."""
        sorted_x, order = x.sort(dim=1, descending=True)  # [B, V]
        probs = sorted_x.softmax(dim=1)
        mass_before = probs.cumsum(dim=1) - probs  # [B, V]: mass of the strictly more likely tokens
        drop = (mass_before > top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        x.masked_fill_(torch.zeros_like(drop).scatter_(1, order, drop), _NEG_INF)

    def _apply_penalties(self, x: torch.Tensor, rows: list[int], reqs: list[Request]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Repetition (HF: over prompt and output, divide positive logits, multiply negative ones), then
        frequency and presence (OpenAI: over generated tokens only, subtracted)."""
        dev = self.device
        slots = torch.tensor([self._slot(reqs[i]) for i in rows], dtype=torch.int64, device=dev)  # [P]
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)  # [P]
        factors = torch.tensor([(reqs[i].params.repetition_penalty, reqs[i].params.frequency_penalty,
                                 reqs[i].params.presence_penalty) for i in rows],
                               dtype=torch.float32, device=dev)  # [P, 3]
        repetition, frequency, presence = (f.unsqueeze(1) for f in factors.unbind(dim=1))  # each [P, 1]
        counts = self._counts.index_select(0, slots)  # [P, V]
        seen = counts > 0
        sub = x.index_select(0, rows_t)  # [P, V]
        occurred = seen | self._prompt_mask.index_select(0, slots)
        sub = torch.where(occurred, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        sub = sub - frequency * counts - presence * seen
        x.index_copy_(0, rows_t, sub)
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
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, reqs: list[Request], rows: list[int]
                  ) -> list[TokenLogprob | None]:
        """From the raw log-softmax: before logit_bias, penalties, temperature and truncation."""
        rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        lp = logits.index_select(0, rows_t).log_softmax(dim=-1)  # [R, V]
        entries = token_logprobs(lp, tokens.index_select(0, rows_t), [reqs[i].params.logprobs for i in rows])
        out: list[TokenLogprob | None] = [None] * len(reqs)
        for i, entry in zip(rows, entries):
            out[i] = entry
        return out
