"""The one error path every refusal takes: x-should-retry: false where a retry cannot help, Retry-After on 429
and 503 (the openai SDK retries 408, 409, 429 and 5xx unless told otherwise)."""
from __future__ import annotations

import pytest

from rawserve.errors import APIError
from rawserve.http.messages import error_response


def header_lines(error: APIError) -> list[bytes]:
    return error_response(error).headers.split(b"\r\n")


@pytest.mark.parametrize("status", [400, 401, 404, 405, 413, 422, 431, 500])
def test_errors_a_retry_cannot_fix_say_do_not_retry(status):
    lines = header_lines(APIError(status, "no"))
    assert b"x-should-retry: false" in lines
    assert not any(line.startswith(b"retry-after") for line in lines)


@pytest.mark.parametrize("status", [429, 503])
def test_429_and_503_say_when_to_come_back_and_may_be_retried(status):
    lines = header_lines(APIError(status, "busy"))
    assert b"retry-after: 1" in lines and not any(line.startswith(b"x-should-retry") for line in lines)
    own = header_lines(APIError(status, "busy", headers=[(b"retry-after", b"7")]))
    assert [line for line in own if line.startswith(b"retry-after")] == [b"retry-after: 7"]


def test_408_may_be_retried_without_a_hint():
    lines = header_lines(APIError(408, "slow"))
    assert not any(line.startswith((b"x-should-retry", b"retry-after")) for line in lines)
