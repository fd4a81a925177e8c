"""Token ids -> what a client sees, for one request: detokenize, hold back and cut at stop strings, decide the end.

The one copy of that path, which AsyncLLM and the offline LLM both call. It returns decisions (a TextOutput, and
whether the core must abort the request) and calls nothing back; it knows no loop, transport or core.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rawserve.engine.types import RequestOutput, SamplingParams, TokenLogprob


@dataclass(slots=True)
class TextOutput:
    """What one request produced since the consumer last read: a visible text delta and its ids."""
    request_id: str
    text: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop token id or the matched stop string
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's vector (RequestOutput.pooled)


class OutputProcessor:
    """One request's text state. `tokenizer=None` (a checkpoint without one): ids pass through, text stays "".

    The core knows no stop strings: when one matches before the core finished the request, process() says
    so, and the caller aborts it in the core.
    """

    __slots__ = ("rid", "_detok", "_stop", "_last")

    def __init__(self, rid: str, tokenizer: Any | None, params: SamplingParams) -> None:
        self.rid = rid
        if tokenizer is None:
            if params.stop:
                raise ValueError("stop: stop strings need a tokenizer, and this checkpoint has none")
            self._detok = self._stop = None
        else:
            # Here, not at the top: offline use with token ids only never loads the tokenizer's libraries.
            from rawserve.text.detokenizer import IncrementalDetokenizer
            from rawserve.text.stop import StopChecker

            self._detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens,
                                                 keep_special=params.keep_special_tokens)
            self._stop = StopChecker(params.stop, params.include_stop_str_in_output)
        self._last: RequestOutput | None = None  # the latest core output: its counts end an abort

    def process(self, out: RequestOutput) -> tuple[TextOutput, bool]:
        """One core output -> (the client's TextOutput, whether to abort the request in the core)."""
        self._last = out
        finished, reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
        visible = ""
        abort = False
        if self._detok is not None:
            stop = self._stop
            ids = out.new_token_ids
            # Several ids in one output (a speculative run): one at a time while stop strings may match, so the
            # output ends at the token that completes one, as it would token by token; later ones are dropped
            deltas = [ids] if len(ids) <= 1 or not stop.has_stops else [[token] for token in ids]
            pieces = []
            for i, delta in enumerate(deltas):
                text = self._detok.add(delta)
                if finished and i == len(deltas) - 1:
                    text += self._detok.flush()
                pieces.append(stop.add(text))
                if stop.stopped is not None:
                    if i < len(deltas) - 1:
                        out = self._last = _keep_tokens(out, i + 1)
                    break
            visible = "".join(pieces)
            if stop.stopped is not None:
                abort = not finished  # the core is still generating: free its blocks at its next step
                finished, reason, stop_reason = True, "stop", stop.stopped
            elif finished:
                visible += stop.finish()
        logprobs = list(out.logprobs) if out.logprobs is not None else None  # thread mode shares the core's list
        return TextOutput(out.request_id, visible, list(out.new_token_ids), finished, reason, stop_reason, logprobs,
                          out.prompt_logprobs, out.num_prompt_tokens, out.num_output_tokens,
                          out.num_cached_tokens, out.pooled), abort

    def cut(self) -> TextOutput:
        """The last TextOutput of a request ended at its deadline: finish_reason "length", as if max_tokens had
        been reached there. The text held back (an incomplete character, a stop string's possible start) goes
        out too, since nothing more will come to settle it."""
        last = self._last
        text, reason, stop_reason = "", "length", None
        if self._detok is not None:
            stop = self._stop
            text = stop.add(self._detok.flush())
            if stop.stopped is not None:
                reason, stop_reason = "stop", stop.stopped
            else:
                text += stop.finish()
        if last is None:
            return TextOutput(self.rid, text, [], True, reason, stop_reason)
        return TextOutput(self.rid, text, [], True, reason, stop_reason, num_prompt_tokens=last.num_prompt_tokens,
                          num_output_tokens=last.num_output_tokens, num_cached_tokens=last.num_cached_tokens)

    def aborted(self) -> TextOutput:
        """The last TextOutput of a request stopped from outside (abort(), a client that left)."""
        last = self._last
        if last is None:
            return TextOutput(self.rid, "", [], True, "abort")
        return TextOutput(self.rid, "", [], True, "abort", None, num_prompt_tokens=last.num_prompt_tokens,
                          num_output_tokens=last.num_output_tokens, num_cached_tokens=last.num_cached_tokens)


def _keep_tokens(out: RequestOutput, num: int) -> RequestOutput:
    """`out` with only its first `num` tokens (and their logprobs)."""
    return dataclasses.replace(out, new_token_ids=out.new_token_ids[:num],
                               logprobs=out.logprobs[:num] if out.logprobs is not None else None,
                               num_output_tokens=out.num_output_tokens - (len(out.new_token_ids) - num))
