"""Per-key token buckets (--rate-limit-tpm, api-key-file overrides): admission charges prompt + max_tokens, the
end refunds what was not generated; OpenAI's 429 and x-ratelimit-* headers.

Buckets exist only for the configured keys (auth refuses any other), so their state is bounded. Event loop only.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

from rawserve.errors import APIError
from rawserve.http import Handler, Request, Response, SSEResponse
from rawserve.http.messages import encode_headers


class TokenBucket:
    """`capacity` tokens (a minute's worth), refilled continuously at capacity / 60 per second."""

    __slots__ = ("capacity", "tokens", "_rate_per_s", "_updated_s", "_clock")

    def __init__(self, tpm: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = tpm
        self.tokens = float(tpm)
        self._rate_per_s = tpm / 60.0
        self._clock = clock
        self._updated_s = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._updated_s) * self._rate_per_s)
        self._updated_s = now

    def take(self, cost: int) -> float:
        """Spend `cost` now and return 0, or spend nothing and return the seconds until it would fit."""
        self._refill()
        if cost <= self.tokens:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self._rate_per_s

    def refund(self, tokens: int) -> None:
        self._refill()
        self.tokens = min(self.capacity, self.tokens + tokens)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-*-tokens: the limit, what is left, and how long until the bucket is full."""
        self._refill()
        reset_s = (self.capacity - self.tokens) / self._rate_per_s
        return [(b"x-ratelimit-limit-tokens", b"%d" % self.capacity),
                (b"x-ratelimit-remaining-tokens", b"%d" % int(self.tokens)),
                (b"x-ratelimit-reset-tokens", duration(reset_s).encode())]


def duration(seconds: float) -> str:
    """OpenAI's reset format: 20ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, secs = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


class Reservation:
    """Tokens one request holds in its key's bucket: settled once, at its end, by refunding the unused part.

    The response loop settles it (serving.choice_chunks). A response never started (its client gone before the
    first byte) keeps its charge; the bucket refills it within the minute, as it would any spending.
    """

    __slots__ = ("_bucket", "_prompt_tokens", "_completion_tokens", "_is_settled")

    def __init__(self, bucket: TokenBucket, prompt_tokens: int, completion_tokens: int) -> None:
        self._bucket = bucket
        self._prompt_tokens = prompt_tokens
        self._completion_tokens = completion_tokens  # what max_tokens reserved for every sample
        self._is_settled = False

    def settle(self, generated: int) -> None:
        """The request ended having generated `generated` tokens: the rest of max_tokens goes back."""
        if not self._is_settled:
            self._is_settled = True
            self._bucket.refund(max(0, self._completion_tokens - generated))

    def cancel(self) -> None:
        """The request was refused after all (overload): it spent nothing."""
        if not self._is_settled:
            self._is_settled = True
            self._bucket.refund(self._prompt_tokens + self._completion_tokens)


class RateLimiter:
    """The buckets of the limited keys: {key: TokenBucket}. Without API keys, the key None (everyone) has one."""

    def __init__(self, limits: dict[str | None, int | None], clock: Callable[[], float] = time.monotonic) -> None:
        self._buckets = {key: TokenBucket(tpm, clock) for key, tpm in limits.items() if tpm is not None}

    @property
    def is_enabled(self) -> bool:
        return bool(self._buckets)

    def bucket(self, api_key: str | None) -> TokenBucket | None:
        return self._buckets.get(api_key)

    def reserve(self, api_key: str | None, prompt_tokens: int, completion_tokens: int) -> Reservation | None:
        """Charge a request's prompt tokens and its max_tokens for every sample, or raise: 400 when it can never
        fit the bucket, 429 with Retry-After (whole seconds) when the bucket is short now."""
        bucket = self._buckets.get(api_key)
        if bucket is None:
            return None
        cost = prompt_tokens + completion_tokens
        if cost > bucket.capacity:
            raise APIError(400, f"This request needs {cost} tokens ({prompt_tokens} in the prompt, {completion_tokens} "
                                f"of max_tokens); your limit is {bucket.capacity} tokens per minute. Reduce the "
                                "prompt or max_tokens.", param="max_tokens", code="request_too_large",
                           headers=bucket.headers())
        wait_s = bucket.take(cost)
        if wait_s > 0:
            raise APIError(429, f"Rate limit reached on tokens per min (TPM): limit {bucket.capacity}, remaining "
                                f"{int(bucket.tokens)}, requested {cost}. Please try again in {wait_s:.3g}s.",
                           code="rate_limit_exceeded", type="tokens",
                           headers=[(b"retry-after", b"%d" % math.ceil(wait_s)), *bucket.headers()])
        return Reservation(bucket, prompt_tokens, completion_tokens)

    def with_headers(self, handler: Handler) -> Handler:
        """`handler` whose responses carry the caller's x-ratelimit-* headers when its key is limited."""
        async def wrapped(request: Request) -> Response | SSEResponse:
            bucket = self._buckets.get(request.api_key)
            try:
                response = await handler(request)
            except APIError as error:
                if bucket is not None and not any(name == b"x-ratelimit-limit-tokens" for name, _ in error.headers):
                    error.headers = [*error.headers, *bucket.headers()]
                raise
            if bucket is not None:
                response.headers += encode_headers(bucket.headers())
            return response
        return wrapped
