"""Offline API: `LLM(model_dir, **engine_options).generate(prompts, params)` drives an EngineCore to completion.
A prompt may carry images as vLLM's do: {"prompt": ..., "multi_modal_data": {"image": PIL.Image or a list}}.

The in-process frontend: it tokenizes text prompts, checks each request's rules, fans out n samples, and folds the
OutputProcessor's decisions into results. It builds the core through the seam's CoreFactory, so the core (and
torch) loads only when an LLM is made.
"""
from __future__ import annotations

import itertools
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from rawserve.config import EngineConfig
from rawserve.engine.frontend.output_processor import OutputProcessor
from rawserve.engine.launch import CoreFactory
from rawserve.engine.mm_inputs import ImageInput, MultiModalInputs, expand_placeholders
from rawserve.engine.rules import check_request, samples
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

    __slots__ = ("result", "completion", "processor")

    def __init__(self, result: GenerationResult, completion: Completion, processor: OutputProcessor) -> None:
        self.result = result
        self.completion = completion
        self.processor = processor


class LLM:
    """Offline batch generation. `model_dir=None` uses the built-in demo model."""

    def __init__(self, model_dir: str | pathlib.Path | None = None, **engine_options) -> None:
        if model_dir is None:
            from rawserve.demo_model import ensure_demo_model

            model_dir = ensure_demo_model()
        self.model_dir = pathlib.Path(model_dir)
        self.config = EngineConfig(model_dir=str(model_dir), **engine_options)
        self.core = CoreFactory(self.config)()
        self._tokenizer = None
        self._tokenizer_loaded = False
        self._image_rules = None  # (ImageProcessorRules, placeholder id), read at the first image
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        """The checkpoint's rawserve.text Tokenizer, or None when it has no tokenizer.json."""
        if not self._tokenizer_loaded:
            self._tokenizer_loaded = True
            self._tokenizer = _load_tokenizer(self.model_dir)
        return self._tokenizer

    def generate(self, prompts: str | dict | Sequence[int] | Sequence[str | dict | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: int = 0, lora: str | None = None) -> list[GenerationResult]:
        """Results in prompt order. A prompt is text or a list of token ids, or vLLM's dict: {"prompt": text} or
        {"prompt_token_ids": ids}, with "multi_modal_data": {"image": a PIL image or a list of them} on a vision
        checkpoint (the prompt holds one image placeholder per image, `<|image_pad|>` for the Qwen-VL family, as
        its chat template renders; each is expanded to the image's tokens, which result.prompt_token_ids shows).
        params is one for all prompts or one per prompt; lora names a loaded adapter (--lora-modules) every
        prompt runs on. Raises ValueError (with nothing left running) if any request is rejected."""
        prompt_list = _normalize_prompts(prompts)
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"params: got {len(param_list)} for {len(prompt_list)} prompts")
        results: list[GenerationResult] = []
        running: dict[str, _Sample] = {}
        batch = next(self._ids)
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, param_list)):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"params: expected SamplingParams, got {type(p).__name__}")
                prompt, images = (prompt.prompt, prompt.images) if isinstance(prompt, _MultiModalPrompt) \
                    else (prompt, ())
                text = prompt if isinstance(prompt, str) else None
                ids = self._encode(prompt) if text is not None else list(prompt)
                features = None
                if images:
                    ids, features = self._place_images(ids, images, f"prompts[{i}]")
                result = GenerationResult(text, ids)
                results.append(result)
                for j, child in enumerate(samples(p)):
                    check_request(ids, child, vocab_size=self.core.vocab_size, max_model_len=self.core.max_model_len)
                    rid = f"llm-{batch}-{i}-{j}"
                    completion = Completion(j, [], None if self.tokenizer is None else "", None, None,
                                            [] if child.logprobs is not None else None)
                    result.outputs.append(completion)
                    running[rid] = _Sample(result, completion, OutputProcessor(rid, self.tokenizer, child))
                    self.core.add_request(rid, ids, child, priority, lora=lora, features=features)
            self._drive(running)
        except BaseException:
            # Leave the engine clean for the next call, whatever interrupted this one.
            for rid in running:
                self.core.abort_request(rid)
            raise
        return results

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompt: {self.model_dir} has no tokenizer.json; pass token ids instead of text")
        return list(self.tokenizer.encode(text))

    def _place_images(self, ids: list[int], images: Sequence, where: str) -> tuple[list[int], MultiModalInputs]:
        """Each image sized by the checkpoint's processor rules (--mm-processor-kwargs included), as the server
        sizes a request's, and its placeholder expanded -> (ids, the core's features)."""
        # Lazily, as the tokenizer: the image rules and Pillow load only for a prompt with images.
        from rawserve.api.media.decode import from_pil
        from rawserve.api.media.processor import IMAGE_PLACEHOLDER, ImageProcessorRules

        if self._image_rules is None:
            rules = ImageProcessorRules.from_dir(self.model_dir, self.config.mm_pixel_bounds())
            if rules is None:
                raise ValueError(f"{where}.multi_modal_data: {self.model_dir} has no vision tower; it takes no images")
            token_id = rules.image_token_id
            if token_id is None and self.tokenizer is not None:
                token_id = self.tokenizer.token_to_id(IMAGE_PLACEHOLDER)
            if token_id is None:
                raise ValueError(f"{self.model_dir}: neither config.json's image_token_id nor a "
                                 f"{IMAGE_PLACEHOLDER} token in its tokenizer")
            self._image_rules = (rules, token_id)
        rules, token_id = self._image_rules
        inputs = []
        for k, image in enumerate(images):
            try:
                decoded = from_pil(image)
                height, width, num_tokens = rules.grid(decoded.height, decoded.width)
            except ValueError as error:
                raise ValueError(f"{where}.multi_modal_data.image[{k}]: {error}") from None
            inputs.append(ImageInput(decoded.content_hash, decoded.width, decoded.height, decoded.rgb, height, width,
                                     0, num_tokens))
        try:
            ids, placed = expand_placeholders(ids, token_id, inputs)
        except ValueError as error:
            raise ValueError(f"{where}: {error}; write one {IMAGE_PLACEHOLDER} per image where the chat template "
                             "would put it") from None
        return ids, MultiModalInputs(placed)

    def _drive(self, samples: dict[str, _Sample]) -> None:
        """Step the core until every sample has finished, folding each output into its Completion."""
        core = self.core
        running = set(samples)
        while running:
            for out in core.step():
                state = samples.get(out.request_id)
                if state is None or out.request_id not in running:
                    continue
                text_out, abort = state.processor.process(out)
                if abort:
                    core.abort_request(out.request_id)
                completion = state.completion
                completion.token_ids.extend(text_out.new_token_ids)
                if completion.text is not None:
                    completion.text += text_out.text
                if completion.logprobs is not None and text_out.logprobs:
                    completion.logprobs.extend(text_out.logprobs)
                if text_out.prompt_logprobs is not None and state.result.prompt_logprobs is None:
                    state.result.prompt_logprobs = text_out.prompt_logprobs
                state.result.num_cached_tokens = text_out.num_cached_tokens
                if text_out.finished:
                    completion.finish_reason, completion.stop_reason = text_out.finish_reason, text_out.stop_reason
                    running.discard(out.request_id)
            if running and not core.has_unfinished:
                raise RuntimeError(f"engine went idle with {len(running)} requests unfinished")


@dataclass(frozen=True, slots=True)
class _MultiModalPrompt:
    """A dict prompt's text or ids and its images."""
    prompt: str | list[int]
    images: tuple


def _is_ids(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _dict_prompt(prompt: dict, where: str) -> str | list[int] | _MultiModalPrompt:
    """vLLM's {"prompt": text} / {"prompt_token_ids": ids}, optionally with {"multi_modal_data": {"image": ...}}."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; expected prompt or "
                         "prompt_token_ids, and multi_modal_data")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"{where}: give exactly one of prompt (text) and prompt_token_ids")
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"{where}.prompt: expected a string")
    else:
        text = prompt["prompt_token_ids"]
        if not _is_ids(text):
            raise ValueError(f"{where}.prompt_token_ids: expected a list of token ids")
        text = list(text)
    data = prompt.get("multi_modal_data")
    if data is None:
        return text
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"{where}.multi_modal_data: expected {{'image': a PIL image or a list of them}}")
    images = data.get("image")
    images = tuple(images) if isinstance(images, (list, tuple)) else (images,) if images is not None else ()
    return _MultiModalPrompt(text, images) if images else text


def _normalize_prompts(prompts) -> list[str | list[int] | _MultiModalPrompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, dict):
        return [_dict_prompt(prompts, "prompts[0]")]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts: expected a string, a list of token ids, a prompt dict, or a non-empty list of those")
    if _is_ids(prompts):
        return [list(prompts)]
    out: list[str | list[int] | _MultiModalPrompt] = []
    for k, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(prompt)
        elif isinstance(prompt, dict):
            out.append(_dict_prompt(prompt, f"prompts[{k}]"))
        elif _is_ids(prompt):
            out.append(list(prompt))
        else:
            raise ValueError(f"prompts[{k}]: expected a string, a list of token ids or a prompt dict")
    return out


def _load_tokenizer(model_dir: pathlib.Path):
    if not (model_dir / "tokenizer.json").is_file():
        return None
    from rawserve.text.tokenizer import Tokenizer  # lazily: token-id users never load the text layer

    return Tokenizer.from_dir(model_dir)
