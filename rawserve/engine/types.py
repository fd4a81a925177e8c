"""The only types that cross the frontend/core boundary: sampling params, requests, per-step outputs.

Small picklable slots dataclasses of ids, numbers and strings. No tensors, tokenizers or callbacks.
"""
from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field

from rawserve.engine.guided.nfa import CompiledGrammar
from rawserve.text.stop import normalize_stop

MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = 0, (1 << 64) - 1  # a torch.Generator's seed is an unsigned 64-bit integer
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_TOP_K = (1 << 31) - 1  # any top_k past the vocabulary keeps it all; past this it is not a count but a typo
# The sampler works in float32. A temperature or a divisor below float32's smallest normal number is 0 or subnormal
# there: logits / it overflow to inf and inf - inf is NaN. Temperatures down there are greedy by rule; a repetition
# penalty there (or past float32's largest) is refused.
FLOAT32_TINY = 2.0 ** -126
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class RequestFailed(RuntimeError):
    """The core failed this request alone, in its sampling, logits processing or grammar (the core lives on).
    The client sees a server error (500), not a rule it broke."""

# One token's logprobs: (token_id, logprob, rank, ((top_id, top_logprob), ...)).
# rank is 1 for the most likely token. The distribution is the model's raw log-softmax over the
# vocabulary (before temperature, penalties and truncation), as vLLM reports by default.
TokenLogprob = tuple[int, float, int, tuple[tuple[int, float], ...]]


POOLING_METHODS = ("last", "mean", "cls")


@dataclass(slots=True)
class PoolingParams:
    """A pooling request (max_tokens 0): the core returns one vector per prompt instead of tokens.

    The vector is the final hidden state pooled by `method` (after the model's final norm), or for a
    sequence-classification encoder its classifier's logits, or, with `logit_ids`, the LM head's logits of
    those ids at the pooled position (Qwen3-Reranker's yes/no). `dimensions` keeps the first d values
    (Matryoshka), and `normalize` then L2-normalises what is kept."""
    method: str = "last"
    normalize: bool = False
    dimensions: int | None = None
    logit_ids: tuple[int, ...] = ()
    # an encoder's sentence pair (a cross-encoder's query and document): tokens from here on have token type 1
    type_split: int = -1

    def validate(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling: method must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            raise ValueError(f"dimensions: must be a positive integer, got {dims!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logit_ids):
            raise ValueError("pooling: logit_ids must be token ids")
        if isinstance(self.type_split, bool) or not isinstance(self.type_split, int) or self.type_split < -1:
            raise ValueError(f"pooling: type_split must be -1 or a token index, got {self.type_split!r}")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Special tokens decoded all the same (the output parsers' markers); the front end's, like `stop`.
    keep_special_tokens: tuple[str, ...] = ()
    # A grammar the output must match (built by the front end; plain lists, so it pickles).
    guided: CompiledGrammar | None = None
    # A pooling request (embeddings, rerank scores): max_tokens 0, nothing sampled, one vector back.
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        self.stop = normalize_stop(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        temperature = self.temperature
        if type(temperature) in (int, float) and 0 < temperature < FLOAT32_TINY:
            self.temperature = 0.0  # greedy by rule: 0 or subnormal in the sampler's float32 (see FLOAT32_TINY)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field.

        The owner of every rule a field obeys on its own; rules that need the engine's numbers (the token ids
        inside the vocabulary, the context) are engine/rules.py's. Runs at construction, and again in the core
        (params may change after it).
        """
        def bad(name: str, message: str) -> None:
            raise ValueError(f"{name}: {message}")

        for name in ("n", "max_tokens", "top_k", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                bad(name, f"must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                bad(name, f"must be a number, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):  # (a huge int compares exactly below)
                bad(name, f"must be a finite number, got {value}")
        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if self.max_tokens < 0:
            # 0 is a scoring request: the prompt is computed (with its prompt_logprobs) and nothing is sampled
            bad("max_tokens", f"must be >= 0, got {self.max_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if 0 < self.temperature < FLOAT32_TINY:  # construction makes these 0; only a later change gets here
            bad("temperature", f"{self.temperature} is below float32's smallest normal number ({FLOAT32_TINY:.4g}); "
                               "use 0 for greedy")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:  # construction made -1 (disabled) 0
            bad("top_k", f"out of range: must be -1 or 0 (disabled) or 1 to {MAX_TOP_K}, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            # It divides logits: 0 or subnormal in float32 would make them inf (and NaN further on)
            bad("repetition_penalty", f"must be > 0 and a normal float32 number (from {FLOAT32_TINY:.4g} to "
                                      f"{FLOAT32_MAX:.4g}), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                bad(name, f"must be an integer or None, got {value!r}")
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                bad(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.guided is not None and not isinstance(self.guided, CompiledGrammar):
            bad("guided", f"must be a CompiledGrammar, got {type(self.guided).__name__}")
        if self.pooling is not None:
            if not isinstance(self.pooling, PoolingParams):
                bad("pooling", f"must be a PoolingParams, got {type(self.pooling).__name__}")
            self.pooling.validate()
            if self.max_tokens != 0:
                bad("max_tokens", f"a pooling request samples nothing: must be 0, got {self.max_tokens}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        normalize_stop(self.stop)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            bad("seed", f"out of range: must be in [{SEED_MIN}, 2**64 - 1], got {self.seed}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            bad("stop_token_ids", "each stop token id must be an integer")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if isinstance(token_id, bool) or not isinstance(token_id, int):
                    bad("logit_bias", f"keys must be integer token ids, got {token_id!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                    bad("logit_bias", f"bias for token {token_id} must be a number, got {bias!r}")
                if not -100 <= bias <= 100:
                    bad("logit_bias", f"bias for token {token_id} must be in [-100, 100], got {bias}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def child(self, j: int) -> SamplingParams:
        """The j-th of n samples, as a single-sample request.

        A seeded request gives each child its own seed, derived by hashing (seed, j), so the n
        samples differ from each other but the whole set is reproducible. A copy, not a new
        construction: the parent was validated, and a child differs only in n = 1 and a 63-bit seed.
        """
        seed = self.seed
        if seed is not None:
            digest = hashlib.sha256(f"{seed}:{j}".encode()).digest()
            seed = int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
        child = copy.copy(self)
        child.n = 1
        child.seed = seed
        return child


@dataclass(slots=True)
class AddRequest:
    """Frontend -> core: one request to schedule."""
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    lora: str | None = None
    features: object | None = None
    cache_salt: str | None = None


@dataclass(slots=True)
class RequestOutput:
    """Core -> frontend: what one step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id (a stop string is set by the frontend)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # finish_reason "error": why the core failed this request alone (the frontend raises RequestFailed)
    error: str | None = None
    # a pooling request's vector (PoolingParams), float32 values, with its finishing output
    pooled: list[float] | None = None


@dataclass(slots=True)
class EngineStats:
    """Core -> frontend, periodically: the gauges and counters /metrics shows."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    steps: int = 0
    num_threads: int = 0  # the engine's intra-op threads now (0: not a CPU engine, or not reported)
    extra: dict = field(default_factory=dict)
