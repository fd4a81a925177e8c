"""Request rules that need the engine's numbers (vocabulary, context length) or span its two halves: one owner each.

The entry points (the API, the offline LLM) call these, and the core calls the same ones as its defensive check.
A broken rule raises RuleError naming the field; the API only translates it into OpenAI's shape. Seam: standard
library only. Field rules that need no context are SamplingParams.validate's (engine/types.py); this module names
SamplingParams for type checking only, and types.py imports nothing from here, so the two never import each other.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rawserve.engine.types import SamplingParams


class RuleError(ValueError):
    """A request breaks a rule. `param` names the field; str() reads "param: message", as the engine reports it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class EmptyPrompt(RuleError):
    def __init__(self, param: str = "prompt") -> None:
        super().__init__(param, "must hold at least one token")


class TokenOutOfVocab(RuleError):
    def __init__(self, param: str, token_id: int, vocab_size: int) -> None:
        super().__init__(param, f"token id {token_id} is outside the vocabulary (size {vocab_size})")
        self.token_id = token_id
        self.vocab_size = vocab_size


class ContextTooLong(RuleError):
    """The prompt plus max_tokens do not fit in max_model_len."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        total = num_prompt_tokens + max_tokens
        super().__init__("max_tokens", f"the prompt's {num_prompt_tokens} tokens plus max_tokens {max_tokens} make "
                                        f"{total}, more than max_model_len ({max_model_len})")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


# ----- the vocabulary range

def check_prompt_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """A prompt holds at least one token, and every id is an integer inside the vocabulary."""
    if not ids:
        raise EmptyPrompt(param)
    try:
        packed: Sequence[int] = array("q", ids)  # one C pass: rejects non-integers
    except TypeError:
        raise RuleError(param, "token ids must be integers") from None
    except OverflowError:  # integers past 64 bits: outside any vocabulary, and named below
        if not all(isinstance(t, int) for t in ids):
            raise RuleError(param, "token ids must be integers") from None
        packed = ids
    if min(packed) < 0 or max(packed) >= vocab_size:  # C-level; the scan below only finds the culprit
        bad = next(t for t in packed if not 0 <= t < vocab_size)
        raise TokenOutOfVocab(param, bad, vocab_size)


def check_token_types(params: SamplingParams) -> None:
    """logit_bias keys and stop_token_ids are integers (before any comparison with a number could raise TypeError)."""
    for param, token_ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
        if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
            raise RuleError(param, "token ids must be integers")


def check_params_vocab(params: SamplingParams, vocab_size: int) -> None:
    """The token ids a request's params name (logit_bias, stop_token_ids) are inside the vocabulary."""
    for param, token_ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise TokenOutOfVocab(param, token_id, vocab_size)


# ----- the context length

def max_prompt_tokens(max_model_len: int) -> int:
    """The longest prompt that leaves room for one generated token."""
    return max_model_len - 1


def default_max_tokens(num_prompt_tokens: int, max_model_len: int) -> int:
    """max_tokens when neither the request nor the endpoint sets it: the rest of the context."""
    return max_model_len - num_prompt_tokens


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ContextTooLong(num_prompt_tokens, max_tokens, max_model_len)


# ----- n: one engine request per sample

def samples(params: SamplingParams) -> list[SamplingParams]:
    """The n single-sample params a request fans out into; sample j seeds from (seed, j) (SamplingParams.child)."""
    return [params] if params.n == 1 else [params.child(j) for j in range(params.n)]


def check_one_sample(params: SamplingParams) -> None:
    if params.n != 1:
        raise RuleError("n", f"the engine core runs one sample per request, got n={params.n}; "
                             "submit params.child(j) for each of the n samples")


# ----- all of them, for one engine request

def check_request(prompt_ids: Sequence[int], params: SamplingParams, *, vocab_size: int,
                  max_model_len: int) -> None:
    """Every rule one engine request must pass: what the offline LLM checks before it submits, and what the
    core checks again on arrival (its params may have been changed after construction)."""
    check_prompt_ids(prompt_ids, vocab_size)
    check_token_types(params)
    params.validate()
    check_params_vocab(params, vocab_size)
    check_one_sample(params)
    check_context(len(prompt_ids), params.max_tokens, max_model_len)
