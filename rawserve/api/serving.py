"""What both OpenAI endpoints share: the serving context, request fields -> SamplingParams, admission,
fan-out of n samples, the one loop over their merged streams, usage and logprobs in OpenAI's shapes.

Every refusal here is an APIError raised before a response header is sent. The rules themselves are the
engine's (SamplingParams.validate, engine/rules.py); this layer translates their errors into OpenAI's shape.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from rawserve.api import access_log, body_gate
from rawserve.api.guided import GrammarCache
from rawserve.api.media import ImageReader
from rawserve.api.protocol import SamplingFields
from rawserve.api.rate_limit import RateLimiter, Reservation
from rawserve.engine import rules
from rawserve.engine.frontend.async_llm import AsyncLLM, RequestStream, TextOutput
from rawserve.engine.guided.nfa import CompiledGrammar
from rawserve.engine.types import MAX_LOGPROBS, SamplingParams, TokenLogprob
from rawserve.errors import APIError, EngineDead, Overloaded
from rawserve.http import Request
from rawserve.text.defaults import GenerationDefaults
from rawserve.text.parsers import OutputParser
from rawserve.text.stop import normalize_stop
from rawserve.text.tokenizer import RELEASE_GIL_AT, Tokenizer, TooManyTokens

# Per-request bounds on work done for every generated token (stop-string scans on the event loop,
# bias tensors in the core): without them one request could slow every other stream. Server policy,
# so the API owns them; the offline LLM has no other streams to protect.
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024


@dataclass(slots=True)
class ServingContext:
    llm: AsyncLLM
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int  # the model's logits width (ids past the tokenizer's are padding rows)
    defaults: GenerationDefaults
    chat_template: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str = "hermes"
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: GrammarCache = None  # type: ignore[assignment]  # built from the tokenizer when not given
    loras: dict[str, str] = field(default_factory=dict)  # LoRA adapters requests may select: name -> directory
    limiter: RateLimiter | None = None  # per-key token buckets (--rate-limit-tpm); None: unlimited
    per_key_cache_salt: bool = True  # each API key's prefix-cache blocks are its own
    kv_cache: dict[str, int] = field(default_factory=dict)  # the pool's capacity: {"tokens", "bytes"} (READY's)
    images: ImageReader | None = None  # reads image parts (api/media); None: every image part is refused

    def caller(self, request: Request) -> Caller:
        """Who sent `request`, as admission needs it: its API key and its own deadline (a 400 if malformed)."""
        return Caller(request.api_key, request_deadline(self, request))

    def cache_salt(self, api_key: str | None, salt: str | None) -> str | None:
        """A request's prefix-cache salt: its own cache_salt combined with its key's, so tenants never share
        blocks (nor learn from hit timings what another one sent)."""
        if api_key is None or not self.per_key_cache_salt:
            return salt
        tenant = "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]  # the core never sees the key itself
        return tenant if salt is None else f"{tenant}|{salt}"

    def __post_init__(self) -> None:
        if self.grammars is None:
            self.grammars = GrammarCache(self.tokenizer)

    def check_model(self, model: str | None) -> None:
        """The base model's name or a loaded adapter's; anything else is OpenAI's 404 model_not_found."""
        if model is not None and model != self.model_name and model not in self.loras:
            raise model_not_found(model)

    def lora_for(self, req: SamplingFields) -> str | None:
        """The adapter a request selects: its lora field, else model naming an adapter (vLLM's convention)."""
        lora = getattr(req, "lora", None)
        if lora is not None:
            if lora not in self.loras:
                raise model_not_found(lora, "lora")
            return lora
        model = req.model
        return model if model is not None and model != self.model_name and model in self.loras else None

    def response_model(self, req: SamplingFields) -> str:
        """The model name a response reports: the adapter's that runs it (lora_for's choice), as vLLM does."""
        return self.lora_for(req) or self.model_name

    async def encode(self, text: str, add_special_tokens: bool = True, prompt_param: str | None = None, *,
                     max_tokens: int | None = None) -> list[int]:
        """Ids for `text`, tokenized in a thread when long. As a prompt (`prompt_param` names its field), one
        that leaves no room for a completion is refused; otherwise one over `max_tokens` is. Either way a text
        far over its limit is refused from its length, or a bounded count, before it is tokenized whole
        (Tokenizer.encode): its memory is bounded by the limit, not by the body."""
        limit = max_tokens if prompt_param is None else rules.max_prompt_tokens(self.max_model_len)
        try:
            if len(text) > RELEASE_GIL_AT:  # in a thread, so the loop keeps serving others
                return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens, limit)
            return self.tokenizer.encode(text, add_special_tokens, limit)
        except TooManyTokens as too_many:
            if prompt_param is None:
                raise APIError(400, f"The text is {'at least ' if too_many.at_least else ''}{too_many.num_tokens} "
                                    f"tokens; at most {limit} are tokenized.",
                               param="prompt", code="context_length_exceeded") from None
            raise self.context_exceeded(too_many.num_tokens, prompt_param, too_many.at_least) from None

    def context_exceeded(self, prompt_len: int, prompt_param: str | None, at_least: bool = False) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                             f"your prompt has {'at least ' if at_least else ''}{prompt_len} tokens, leaving no "
                             "room for a completion.", param=prompt_param, code="context_length_exceeded")

    async def decode(self, ids: list[int]) -> str:
        if len(ids) > RELEASE_GIL_AT:
            return await asyncio.to_thread(self.tokenizer.decode, ids)
        return self.tokenizer.decode(ids)

    def sampling_params(self, req: SamplingFields, prompt_len: int, default_max_tokens: int | None,
                        prompt_param: str, *, logprobs: int | None = None,
                        prompt_logprobs: int | None = None, guided: CompiledGrammar | None = None,
                        scoring: bool = False, keep_special_tokens: tuple[str, ...] = ()) -> SamplingParams:
        """Request fields -> SamplingParams with the checkpoint's defaults; a 400 naming the field if bad.

        max_tokens 0 (the prompt is computed, nothing sampled) is allowed only where `scoring` says the caller
        has a use for it (completions with echo). `keep_special_tokens`: the output parsers' markers, decoded
        even under skip_special_tokens."""
        if prompt_len > rules.max_prompt_tokens(self.max_model_len):
            raise self.context_exceeded(prompt_len, prompt_param)
        max_tokens = req.max_tokens if req.max_tokens is not None else default_max_tokens
        if max_tokens is None:
            max_tokens = rules.default_max_tokens(prompt_len, self.max_model_len)
        if max_tokens == 0 and not scoring:
            raise APIError(400, "max_tokens: must be >= 1, got 0 (0 is a scoring request: /v1/completions with "
                                "echo).", param="max_tokens")
        if isinstance(max_tokens, int) and max_tokens >= 1:  # else SamplingParams names max_tokens below
            try:
                rules.check_context(prompt_len, max_tokens, self.max_model_len)
            except rules.ContextTooLong:
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                    f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                                    f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                                    "completion.", param="max_tokens", code="context_length_exceeded") from None
        d = self.defaults

        def pick(value, default, fallback):
            return value if value is not None else (default if default is not None else fallback)

        if len(req.logit_bias or ()) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(req.logit_bias)}.",
                           param="logit_bias")
        try:
            stop = normalize_stop(req.stop)
        except ValueError as error:
            raise APIError(400, str(error), param="stop") from None
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise APIError(400, f"stop may hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                                "characters each.", param="stop")
        try:
            bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings).",
                           param="logit_bias") from None
        stop_ids = tuple(req.stop_token_ids or ())
        if not req.ignore_eos:
            stop_ids += tuple(i for i in d.eos_token_ids if i not in stop_ids)
        try:
            params = SamplingParams(
                n=req.n, max_tokens=max_tokens, temperature=pick(req.temperature, d.temperature, 1.0),
                top_p=pick(req.top_p, d.top_p, 1.0), top_k=pick(req.top_k, d.top_k, 0),
                min_p=pick(req.min_p, d.min_p, 0.0),
                repetition_penalty=pick(req.repetition_penalty, d.repetition_penalty, 1.0),
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, seed=req.seed,
                stop=stop, stop_token_ids=stop_ids, include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logit_bias=bias or None,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                keep_special_tokens=keep_special_tokens, guided=guided)
            rules.check_params_vocab(params, self.vocab_size)  # the field rules ran as it was built
        except ValueError as error:
            name, _, message = str(error).partition(": ")
            raise APIError(400, str(error), param=name if message else None) from None
        if params.n > MAX_N:
            raise APIError(400, f"n must be at most {MAX_N}, got {params.n}.", param="n")
        return params

    def check_prompt_ids(self, ids: Sequence[int], param: str) -> None:
        try:
            rules.check_prompt_ids(ids, self.vocab_size, param)
        except rules.EmptyPrompt:
            raise APIError(400, "The prompt is empty.", param=param) from None
        except rules.TokenOutOfVocab as error:
            raise APIError(400, f"Token id {error.token_id} is out of vocabulary (size {self.vocab_size}).",
                           param=param) from None
        except rules.RuleError as error:
            raise APIError(400, str(error), param=param) from None

    def check_capacity(self, num_prompts: int, n: int) -> None:
        """Room for num_prompts x n engine requests: a 400 if they could never fit --max-pending (instead of
        admitting some and aborting them), a 503 if they do not fit now."""
        needed = num_prompts * n
        if needed > self.llm.max_pending:
            raise APIError(400, f"This request needs {needed} engine requests ({num_prompts} prompt(s) x n={n}); "
                                f"the server runs at most {self.llm.max_pending} at once (--max-pending).",
                           param="prompt" if num_prompts > 1 else "n")
        try:
            self.llm.check_capacity(needed)
        except Overloaded as error:
            raise overloaded(error) from None

    def start_streams(self, prompts: list[list[int]], params: SamplingParams, rid: str,
                      req: SamplingFields, caller: Caller | None = None,
                      features: object | None = None) -> list[RequestStream]:
        """One engine request per (prompt, sample); choice index = prompt * n + sample. `caller` brings the
        request's own deadline and its key (its token bucket and prefix-cache salt). `features`: every prompt's
        images (MultiModalInputs), for the one prompt a chat request has.

        Admission is all-or-nothing: a refusal part-way aborts the streams already started and refunds the
        tokens charged. A request admitted holds them in `caller.reservation` until its response settles it.
        """
        caller = caller if caller is not None else Caller()
        record = access_log.current()
        if record is not None and record.rid is None:
            record.rid = rid
        self.check_capacity(len(prompts), params.n)
        lora = self.lora_for(req)
        if self.limiter is not None:
            caller.reservation = self.limiter.reserve(caller.api_key, sum(map(len, prompts)),
                                                      len(prompts) * params.n * params.max_tokens)
        self.llm.metrics.observe_many("request_params_n", [params.n] * len(prompts))  # per prompt, as vLLM's
        salt = self.cache_salt(caller.api_key, req.cache_salt)
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                for j, child in enumerate(rules.samples(params)):
                    streams.append(self.llm.generate(ids, child, f"{rid}-{i}-{j}", req.priority,
                                                     cache_salt=salt, lora=lora, timeout_s=caller.timeout_s,
                                                     features=features))
        except (Overloaded, EngineDead, ValueError) as error:
            for stream in streams:
                self.llm.abort(stream.request_id)
            if caller.reservation is not None:
                caller.reservation.cancel()
            if isinstance(error, ValueError):
                raise APIError(400, str(error)) from None
            raise overloaded(error) from None
        body_gate.release_early()  # the prompt is admitted: the next large body may be parsed
        return streams


@dataclass(slots=True)
class Caller:
    """Who sent a request: the API key that passed auth (None without auth), its own deadline (X-Request-Timeout;
    None: the server's), and, once admitted, the tokens it holds in its key's bucket."""
    api_key: str | None = None
    timeout_s: float | None = None
    reservation: Reservation | None = None


REQUEST_TIMEOUT_HEADER = "x-request-timeout"


def request_deadline(ctx: ServingContext, request: Request) -> float | None:
    """X-Request-Timeout (seconds, a float) as this request's deadline, capped by --request-timeout-s; None when
    absent. At the deadline the client gets what was generated so far with finish_reason "length"."""
    value = request.headers.get(REQUEST_TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        timeout_s = float(value)
    except ValueError:
        timeout_s = math.nan
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise APIError(400, f"X-Request-Timeout must be a positive number of seconds, got {value!r}.",
                       param="X-Request-Timeout")
    return min(timeout_s, ctx.llm.request_timeout_s)


def model_not_found(name: str, param: str = "model") -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param=param, code="model_not_found",
                    type="NotFoundError")


def overloaded(error: Exception) -> APIError:
    if isinstance(error, EngineDead):
        return APIError(503, f"The engine is not available: {error}", code="engine_dead")
    return APIError(503, f"The server is overloaded: {error}", code="overloaded")


def stream_error(error: BaseException) -> APIError:
    """An exception raised by an engine stream, as the APIError a client sees."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, (EngineDead, Overloaded)):
        return overloaded(error)
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    return APIError(500, "The engine failed while generating.", code="internal_error")


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, TextOutput]]:
    """Interleave the streams' outputs as they arrive, as (stream index, output).

    Leaving early (an exception, or the consumer being cancelled) closes every stream, which aborts
    its request in the core.
    """
    if len(streams) == 1:  # the common case, without a task per step
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(s.__anext__()): k for k, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                k = pending.pop(future)
                try:
                    out = future.result()
                except StopAsyncIteration:
                    continue
                yield k, out
                if not out.finished:
                    pending[asyncio.ensure_future(streams[k].__anext__())] = k
    finally:
        for future in pending:
            future.cancel()
        for stream in streams:
            await stream.aclose()


@dataclass(slots=True)
class ChoiceChunk:
    """One output of one choice, as every response renders it: counted, parsed, its finish reason decided."""
    index: int  # the choice: prompt * n + sample
    out: TextOutput
    deltas: list[dict] | None  # the output parser's message deltas; None without parsers (completions)
    finish_reason: str | None  # set on the choice's final chunk


async def choice_chunks(streams: list[RequestStream], tally: UsageTally, parsers: list[OutputParser] | None = None,
                        finish_reason: Callable[[TextOutput, OutputParser | None], str | None] | None = None
                        ) -> AsyncIterator[ChoiceChunk]:
    """The loop every response runs, streamed or not: merge -> tally -> parse -> finish.

    A streamed response renders each chunk as SSE events; a whole one folds them. `finish_reason(out, parser)`
    decides a choice's finish_reason from its final output (default: the engine's). An engine failure comes
    out as the APIError its client sees.
    """
    record = access_log.current()  # the access line's tokens, TTFT and finish reasons
    if record is not None:
        record.tally = tally
        if streams and record.rid is None:
            record.rid = streams[0].request_id
    try:
        async for k, out in merge(streams):
            tally.add(k, out)
            if record is not None and record.first_token_s is None and out.new_token_ids:
                record.first_token()
            parser = parsers[k] if parsers is not None else None
            deltas = parser.feed(out.text, final=out.finished) if parser is not None else None
            reason = None
            if out.finished:
                reason = finish_reason(out, parser) if finish_reason is not None else out.finish_reason
                if record is not None:
                    record.finish_reasons.append(reason or "none")
            yield ChoiceChunk(k, out, deltas, reason)
    except Exception as error:  # the engine's failure: a 4xx/5xx before the header, an SSE error event after
        raise stream_error(error) from None
    finally:
        tally.settle()


class UsageTally:
    """Token counts of one HTTP request's choices, for OpenAI's `usage` object.

    Choice k samples prompt k // n. A prompt is counted once however many samples it has, and its
    cached tokens are the fewest any of its samples found, so cached_tokens never exceeds prompt_tokens
    (later samples of one prompt may hit blocks an earlier one just computed).
    """

    __slots__ = ("_prompt_lens", "_n", "_cached", "completion_tokens", "_running", "reservation")

    def __init__(self, prompt_lens: list[int], n: int, reservation: Reservation | None = None) -> None:
        self._prompt_lens = prompt_lens
        self._n = n
        self.reservation = reservation  # the tokens the request holds in its key's bucket, settled at its end
        self._cached: list[int | None] = [None] * len(prompt_lens)
        self.completion_tokens = 0
        self._running: dict[int, int] = {}  # choice -> tokens so far, while it is unfinished

    def add(self, k: int, out: TextOutput) -> None:
        """Count choice k's output: its tokens so far, and its final count once it ends."""
        if not out.finished:
            if out.num_output_tokens:
                self._running[k] = out.num_output_tokens
            return
        self._running.pop(k, None)
        self.completion_tokens += out.num_output_tokens
        i = k // self._n
        seen = self._cached[i]
        self._cached[i] = out.num_cached_tokens if seen is None else min(seen, out.num_cached_tokens)

    def settle(self) -> None:
        """The request ended (whole, cut short or failed): refund what its max_tokens reserved and it did not
        generate."""
        if self.reservation is not None:
            self.reservation.settle(self.completion_tokens + sum(self._running.values()))

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self._prompt_lens)

    def usage(self, running: bool = False) -> dict:
        """OpenAI's usage object; `running` also counts unfinished choices' tokens so far (vLLM's
        continuous_usage_stats)."""
        prompt_tokens = sum(self._prompt_lens)
        completion_tokens = self.completion_tokens + (sum(self._running.values()) if running else 0)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(c or 0 for c in self._cached)}}


def wants_usage_chunk(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def wants_continuous_usage(req: SamplingFields) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage (tokens so far) on every chunk of a stream."""
    return req.stream_options is not None and req.stream_options.continuous_usage_stats


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}.", param=param)


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and raw bytes, as OpenAI's logprobs report them."""
    raw = tokenizer.token_bytes(token_id) if 0 <= token_id < tokenizer.vocab_size else b""
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    content = []
    for token_id, logprob, _rank, top in entries:
        text, raw = token_text(tokenizer, token_id)
        tops = []
        for top_id, top_lp in top:
            top_text, top_raw = token_text(tokenizer, top_id)
            tops.append({"token": top_text, "logprob": top_lp, "bytes": top_raw})
        content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob], text_offset: int,
                        num_top: int) -> dict:
    """OpenAI's legacy logprobs: tokens, token_logprobs, top_logprobs and text_offset, one item per entry.

    Each top_logprobs item holds the num_top most likely tokens plus the token itself (so logprobs 0 still
    reports it), as OpenAI and vLLM do. An entry whose logprob is None (an echoed prompt's first token, which
    nothing predicts) reports null for both.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, logprob, _rank, top in entries:
        text, _ = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        if logprob is None:
            top_logprobs.append(None)
        else:
            tops = {token_text(tokenizer, i)[0]: lp for i, lp in top[:num_top]}
            tops.setdefault(text, logprob)
            top_logprobs.append(tops)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}
