"""Proposers: a request's tokens so far in, up to k drafted next tokens out. N-gram prompt lookup, and a
synthetic proposer for benchmarks. Plain Python over token ids: no torch, no model.
"""
from __future__ import annotations

import random
from array import array
from dataclasses import dataclass

_ITEM = array("i").itemsize  # token ids fit in a C int (vocabularies are far below 2**31)


@dataclass(slots=True)
class Proposal:
    """What one request drafts for one step."""
    tokens: list[int]
    # Synthetic only: how many leading drafts the verifier takes as the target's own without comparing (the
    # benchmark's acceptance); 0 for a real proposer, whose drafts are all verified.
    num_forced: int = 0


class NgramProposer:
    """vLLM's prompt lookup: the longest n in [min_n, max_n] whose last n tokens occurred before, and the tokens
    that followed their latest earlier occurrence. The search is bytes.rfind over the ids packed as C ints, so a
    long context costs a memory scan, not a Python loop per token."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], k: int) -> Proposal:
        num = len(token_ids)
        if num < self.min_n + 1 or k < 1:
            return Proposal([])
        haystack = array("i", token_ids).tobytes()
        # A match must end before the last token, so at least one token follows it: search all but the last.
        limit = (num - 1) * _ITEM
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            pattern = haystack[(num - n) * _ITEM:]
            end = limit
            while True:
                at = haystack.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % _ITEM == 0:  # a byte match across two ids is not a token match
                    start = at // _ITEM + n
                    return Proposal(token_ids[start:start + k])
                end = at + len(pattern) - 1
        return Proposal([])


class SyntheticProposer:
    """For benchmarks on random weights (llama.cpp's --spec-synth-len): always drafts k tokens and draws how many
    of them count as accepted, so that a verified step emits `acceptance_length` tokens on average (the target's
    own token included). Each draft position is accepted with one probability a, given the one before was, as
    a real proposer's acceptance falls off; a is solved for the mean. The drafts are the last tokens repeated:
    their ids do not matter, since the verifier does not compare them. The output is not the model's."""

    def __init__(self, k: int, acceptance_length: float, seed: int = 0) -> None:
        self.k = k
        self.acceptance_length = acceptance_length
        self.rate = _rate_for_mean(k, acceptance_length - 1.0)
        self._rng = random.Random(seed)

    def propose(self, token_ids: list[int], k: int) -> Proposal:
        if k < 1:
            return Proposal([])
        num_forced = 0
        while num_forced < min(k, self.k) and self._rng.random() < self.rate:
            num_forced += 1
        drafts = [token_ids[-1 - (i % len(token_ids))] for i in range(min(k, self.k))]
        return Proposal(drafts, num_forced)


def _rate_for_mean(k: int, mean_accepted: float) -> float:
    """The per-position acceptance a whose capped geometric mean a + a^2 + ... + a^k equals mean_accepted."""
    if mean_accepted <= 0:
        return 0.0
    if mean_accepted >= k:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        mean = sum(mid ** i for i in range(1, k + 1))
        low, high = (mid, high) if mean < mean_accepted else (low, mid)
    return (low + high) / 2
