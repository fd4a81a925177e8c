"""Offline API: `LLM(model_dir, **engine_options).generate(prompts, params)` drives an EngineCore to completion.

The in-process frontend (like async_llm, not core side): it tokenizes text prompts, fans out n samples,
detokenizes and enforces stop strings. rawserve.text is imported lazily, so token-id use loads only the core.
"""
from __future__ import annotations

import itertools
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from rawserve.config import EngineConfig
from rawserve.engine.core import EngineCore
from rawserve.engine.types import SamplingParams, TokenLogprob


@dataclass(slots=True)
class Completion:
    """One of a prompt's n samples."""
    index: int
    token_ids: list[int]
    text: str | None  # None when the checkpoint has no tokenizer
    finish_reason: str | None  # stop | length
    stop_reason: int | str | None  # the stop token id or stop string; None for EOS and length
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0


class _Sample:
    """Frontend-side state of one sample while it runs."""

    __slots__ = ("result", "completion", "detok", "stop", "logprobs_on")

    def __init__(self, result: GenerationResult, completion: Completion, detok, stop, logprobs_on: bool) -> None:
        self.result = result
        self.completion = completion
        self.detok = detok
        self.stop = stop
        self.logprobs_on = logprobs_on


class LLM:
    """Offline batch generation. `model_dir=None` uses the built-in demo model."""

    def __init__(self, model_dir: str | pathlib.Path | None = None, **engine_options) -> None:
        if model_dir is None:
            from rawserve.demo_model import ensure_demo_model

            model_dir = ensure_demo_model()
        self.model_dir = pathlib.Path(model_dir)
        self.config = EngineConfig(model_dir=str(model_dir), **engine_options)
        self.core = EngineCore(self.config)
        self._tokenizer = None
        self._tokenizer_loaded = False
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        """The checkpoint's rawserve.text Tokenizer, or None when it has no tokenizer.json."""
        if not self._tokenizer_loaded:
            self._tokenizer_loaded = True
            self._tokenizer = _load_tokenizer(self.model_dir)
        return self._tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: int = 0) -> list[GenerationResult]:
        """Results in prompt order. A prompt is text or a list of token ids; params is one for all prompts
        or one per prompt. Raises ValueError (with nothing left running) if any request is rejected."""
        prompt_list = _normalize_prompts(prompts)
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"params: got {len(param_list)} for {len(prompt_list)} prompts")
        results: list[GenerationResult] = []
        samples: dict[str, _Sample] = {}
        batch = next(self._ids)
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, param_list)):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"params: expected SamplingParams, got {type(p).__name__}")
                text = prompt if isinstance(prompt, str) else None
                ids = self._encode(prompt) if text is not None else list(prompt)
                result = GenerationResult(text, ids)
                results.append(result)
                for j in range(p.n):
                    child = p.child(j) if p.n > 1 else p
                    rid = f"llm-{batch}-{i}-{j}"
                    completion = Completion(j, [], None, None, None, [] if child.logprobs is not None else None)
                    result.outputs.append(completion)
                    samples[rid] = self._sample_state(result, completion, child)
                    self.core.add_request(rid, ids, child, priority)
            self._drive(samples)
        except BaseException:
            # Leave the engine clean for the next call, whatever interrupted this one.
            for rid in samples:
                self.core.abort_request(rid)
            raise
        return results

    def _sample_state(self, result: GenerationResult, completion: Completion, params: SamplingParams) -> _Sample:
        tokenizer = self.tokenizer
        if tokenizer is None:
            if params.stop:
                raise ValueError("stop: stop strings need a tokenizer, and this checkpoint has none")
            return _Sample(result, completion, None, None, params.logprobs is not None)
        from rawserve.text.detokenizer import IncrementalDetokenizer
        from rawserve.text.stop import StopChecker

        completion.text = ""
        return _Sample(result, completion, IncrementalDetokenizer(tokenizer, params.skip_special_tokens),
                       StopChecker(params.stop, params.include_stop_str_in_output),
                       params.logprobs is not None)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompt: {self.model_dir} has no tokenizer.json; pass token ids instead of text")
        return list(self.tokenizer.encode(text))

    def _drive(self, samples: dict[str, _Sample]) -> None:
        core = self.core
        running = set(samples)
        while running:
            for out in core.step():
                state = samples.get(out.request_id)
                if state is None or out.request_id not in running:
                    continue
                completion = state.completion
                completion.token_ids.extend(out.new_token_ids)
                if state.logprobs_on and out.logprobs:
                    completion.logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None and state.result.prompt_logprobs is None:
                    state.result.prompt_logprobs = out.prompt_logprobs
                state.result.num_cached_tokens = out.num_cached_tokens
                finished, reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
                if state.detok is not None:
                    delta = state.detok.add(out.new_token_ids)
                    if finished:
                        delta += state.detok.flush()
                    completion.text += state.stop.add(delta)
                    if state.stop.stopped is not None:
                        if not finished:
                            core.abort_request(out.request_id)  # the core does not see stop strings
                        finished, reason, stop_reason = True, "stop", state.stop.stopped
                    elif finished:
                        completion.text += state.stop.finish()
                if finished:
                    completion.finish_reason, completion.stop_reason = reason, stop_reason
                    running.discard(out.request_id)
            if running and not core.has_unfinished:
                raise RuntimeError(f"engine went idle with {len(running)} requests unfinished")


def _normalize_prompts(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts: expected a string, a list of token ids, or a non-empty list of those")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    out: list[str | list[int]] = []
    for k, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            out.append(list(prompt))
        else:
            raise ValueError(f"prompts[{k}]: expected a string or a list of token ids")
    return out


def _load_tokenizer(model_dir: pathlib.Path):
    if not (model_dir / "tokenizer.json").is_file():
        return None
    from rawserve.text.tokenizer import Tokenizer  # lazily: token-id users never load the text layer

    return Tokenizer.from_dir(model_dir)
