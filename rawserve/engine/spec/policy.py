"""BatchPolicy: whether a step drafts at all, from measured step times. Per bucket of decoding rows it keeps the
output tokens per second of drafted and of plain decode steps, and drafts while drafting wins; the mode not in
use is probed now and then (one step) so its estimate follows the load and the requests' acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass

# The choice before a bucket has its own measurements: drafting below this many decoding rows. bench/spec.py,
# Qwen3-0.6B shape, bf16, one thread on a loaded 2-core box, k = 4: a verify step cost 1.0-1.3x a plain one at 1
# stream and 1.9x at 8 streams, where only L >= 2.3 gained (1.29x at L = 3, 0.52x at L = 1).
PRIOR_OFF_AT = 8
_ALPHA = 0.3  # weight of a new step in a mode's average: a loaded box's step times jump by 2x from one to the next
_MIN_SAMPLES = 2  # steps of each mode a bucket has timed before its measurements decide
# Hysteresis: drafting turns on above this ratio of drafted to plain throughput, off below the other, so a
# bucket near break-even does not flip on every probe's noise
_ON_ABOVE = 1.15
_OFF_BELOW = 0.87
# Steps between probes of the mode not in use: the first after _FIRST_GAP steps, each probe that confirms the
# choice doubling the gap up to _MAX_GAP (at most one step in 64, then far fewer, runs the losing mode). A probe
# whose step beats the mode in use by the margin above brings the next one within _CONFIRM_GAP, and _WINS_TO_FLIP
# such probes in a row flip the bucket: one step's time on a loaded box decides nothing.
_FIRST_GAP = 64
_CONFIRM_GAP = 4
_MAX_GAP = 1024
_WINS_TO_FLIP = 3


def _average(mean: float, samples: int, value: float) -> float:
    return value if samples == 0 else mean + _ALPHA * (value - mean)


def bucket_of(num_rows: int) -> int:
    """Rows 1, 2-3, 4-7, 8-15, ...: a step's cost per token changes with the batch's order of magnitude."""
    return max(1, num_rows).bit_length()


@dataclass(slots=True)
class _Bucket:
    on: bool
    steps: int = 0
    next_probe: int = _FIRST_GAP
    gap: int = _FIRST_GAP
    spec_rate: float = 0.0  # output tokens per second of drafted steps, averaged
    plain_rate: float = 0.0
    spec_samples: int = 0
    plain_samples: int = 0
    wins: int = 0  # probes in a row whose step beat the mode in use

    @property
    def ratio(self) -> float | None:
        """Drafted over plain throughput, once both modes are timed."""
        if self.spec_samples < _MIN_SAMPLES or self.plain_samples < _MIN_SAMPLES or self.plain_rate <= 0:
            return None
        return self.spec_rate / self.plain_rate


class BatchPolicy:
    """`choose(num_rows)` before a step: draft or not (and whether that is a probe); `record(...)` once the step's
    time is known. Only decode steps are recorded (a prefill chunk's time says nothing of decoding)."""

    def __init__(self, prior_off_at: int = PRIOR_OFF_AT) -> None:
        self.prior_off_at = prior_off_at
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, num_rows: int) -> _Bucket:
        key = bucket_of(num_rows)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _Bucket(on=(1 << (key - 1)) < self.prior_off_at)
        return bucket

    def choose(self, num_rows: int) -> tuple[bool, bool]:
        """(draft this step, it is a probe of the mode not in use)."""
        bucket = self._bucket(num_rows)
        bucket.steps += 1
        if bucket.steps >= bucket.next_probe:
            return not bucket.on, True
        return bucket.on, False

    def record(self, num_rows: int, drafted: bool, tokens: int, seconds: float, probe: bool) -> None:
        """One decode step: `tokens` output tokens in `seconds`, drafted or not."""
        if seconds <= 0 or tokens <= 0:
            return
        bucket = self._bucket(num_rows)
        rate = tokens / seconds
        if drafted:
            bucket.spec_rate = _average(bucket.spec_rate, bucket.spec_samples, rate)
            bucket.spec_samples += 1
        else:
            bucket.plain_rate = _average(bucket.plain_rate, bucket.plain_samples, rate)
            bucket.plain_samples += 1
        if not probe:
            return
        if drafted != bucket.on and self._beats(bucket, drafted, rate):
            bucket.wins += 1
            if bucket.wins >= _WINS_TO_FLIP:
                bucket.on, bucket.wins, bucket.gap = drafted, 0, _FIRST_GAP
            else:
                bucket.gap = _CONFIRM_GAP
        else:  # the choice stands (a probe that found no row to draft for counts as one)
            bucket.wins = 0
            bucket.gap = min(_MAX_GAP, max(_FIRST_GAP, 2 * bucket.gap))
        bucket.next_probe = bucket.steps + bucket.gap

    @staticmethod
    def _beats(bucket: _Bucket, drafted: bool, rate: float) -> bool:
        """The probe's step beat the average of the mode in use by the margin a flip needs."""
        in_use, samples = (bucket.plain_rate, bucket.plain_samples) if drafted else \
            (bucket.spec_rate, bucket.spec_samples)
        if samples < _MIN_SAMPLES:
            return False
        return rate > _ON_ABOVE * in_use if drafted else rate * _OFF_BELOW > in_use

    def describe(self, num_rows: int) -> str:
        """Why a step of this many rows drafts nothing, for the stats line."""
        bucket = self._bucket(num_rows)
        ratio = bucket.ratio
        if ratio is None:
            return f"off: {num_rows} rows decode (before measuring: {self.prior_off_at}+ rows)"
        return f"off: {num_rows} rows decode (measured: drafting {ratio:.2f}x plain)"

    def stats(self) -> list[dict]:
        return [{"rows": f"{1 << (key - 1)}-{(1 << key) - 1}", "on": b.on,
                 "ratio": None if b.ratio is None else round(b.ratio, 3), "spec_samples": b.spec_samples,
                 "plain_samples": b.plain_samples} for key, b in sorted(self.buckets.items())]
