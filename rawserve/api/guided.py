"""Structured output fields -> one compiled grammar per request: response_format, forced tool calls,
vLLM's guided_* and structured_outputs. Compiled in worker processes under a deadline; a repeated grammar is a
cache hit.

Every bad schema, pattern or grammar is a 400 naming its field; the engine only ever sees grammars
that compiled.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from rawserve.api.compile_workers import CallTimedOut, CompileWorkers, WorkerDied, WorkersBusy
from rawserve.engine.guided.gbnf import parse_gbnf
from rawserve.engine.guided.grammar import (Grammar, GrammarError, Ref, Repeat, Token, alt, byte_set, iter_tokens, lit,
                                            seq)
from rawserve.engine.guided.json_schema import json_object_grammar, schema_to_grammar
from rawserve.engine.guided.nfa import CompiledGrammar, compile_grammar
from rawserve.engine.guided.regex import parse_regex
from rawserve.engine.guided.tool_calls import HARMONY_CALL_MARKERS, tool_call_grammar
from rawserve.errors import APIError
from rawserve.text.tokenizer import Tokenizer

ANY_BYTE = byte_set([(0, 255)])
MAX_SPEC_CHARS = 256 * 1024  # a schema, pattern or grammar's text; larger ones are refused
MAX_CHOICES = 4096
CACHE_SIZE = 256
MAX_CACHED_STATES = 2_000_000  # NFA states over all cached grammars (about 40 bytes each)
# The largest grammars the limits allow (250,000 NFA states) compile in about a second on one busy core.
COMPILE_TIMEOUT_S = 5.0
COMPILE_WORKERS = 2

HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
HARMONY_PROMPT_END = "<|start|>assistant"  # where gpt-oss's template leaves the model: inside a header
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """What one request asks to be constrained by, before compiling: kind, its text, and the field."""
    kind: str  # json | json_object | regex | choice | grammar | tools
    text: str  # canonical JSON or the raw pattern/grammar; the cache key with the kind
    param: str
    # A reasoning model's <think> block before the constrained answer: "" none, "open" (the prompt opened it:
    # free text until </think>), "may" (the model may open one first).
    think: str = ""

    @property
    def key(self) -> str:
        return f"{self.kind}\x00{self.think}\x00{self.text}"


@dataclass(frozen=True, slots=True)
class ToolForcing:
    """tool_choice 'required' or a named function, as a grammar input."""
    tools: tuple[tuple[int, str, str], ...]  # (index in the request's tools, name, parameters as JSON or "")
    parallel: bool
    style: str


def _json_text(value: object, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise APIError(400, f"{param} is not valid JSON: {error}", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise APIError(400, f"{param} must be a JSON Schema object.", param=param)
    return json.dumps(value, ensure_ascii=False)  # key order kept: it is the output's property order


def request_spec(req, *, tools: ToolForcing | None = None, think: str = "") -> GuidedSpec | None:
    """The one constraint a chat or completion request carries (400 if it names more than one)."""
    found: list[GuidedSpec] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(GuidedSpec("json_object", "", "response_format"))
        else:
            body = fmt.json_schema
            if not isinstance(body, dict):
                raise APIError(400, "response_format.json_schema is required when type is 'json_schema'.",
                               param="response_format.json_schema")
            if "schema" in body:
                found.append(GuidedSpec("json", _json_text(body["schema"], "response_format.json_schema.schema"),
                                        "response_format.json_schema.schema"))
            else:  # OpenAI allows a schema-less entry: any JSON object
                found.append(GuidedSpec("json_object", "", "response_format.json_schema"))
    if req.guided_json is not None:
        found.append(GuidedSpec("json", _json_text(req.guided_json, "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        found.append(GuidedSpec("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(GuidedSpec("choice", _choice_text(req.guided_choice, "guided_choice"), "guided_choice"))
    if req.guided_grammar is not None:
        found.append(GuidedSpec("grammar", req.guided_grammar, "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        for kind in _STRUCTURED_KINDS:
            value = getattr(so, kind)
            if value is None or value is False:
                continue
            param = f"structured_outputs.{kind}"
            if kind == "json":
                found.append(GuidedSpec("json", _json_text(value, param), param))
            elif kind == "json_object":
                found.append(GuidedSpec("json_object", "", param))
            elif kind == "choice":
                found.append(GuidedSpec("choice", _choice_text(value, param), param))
            else:
                found.append(GuidedSpec(kind, value, param))
    if tools is not None:
        text = json.dumps([tools.style, tools.parallel, tools.tools], ensure_ascii=False)
        found.append(GuidedSpec("tools", text, "tool_choice"))
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise APIError(400, f"Only one structured output constraint may be given per request, got: {names}.",
                       param=found[1].param)
    spec = dataclasses.replace(found[0], think=think) if found else None
    if spec is not None and len(spec.text) > MAX_SPEC_CHARS:
        raise APIError(400, f"{spec.param} is {len(spec.text)} characters; the limit is {MAX_SPEC_CHARS}.",
                       param=spec.param)
    return spec


def _choice_text(choices: object, param: str) -> str:
    if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)):
        raise APIError(400, f"{param} must be a list of 1 to {MAX_CHOICES} non-empty strings.", param=param)
    return json.dumps(choices, ensure_ascii=False)


def think_mode(prompt: str, reasoning_parser: str | None) -> str:
    """How a constrained answer starts for a reasoning model: after the block the prompt opened ("open"),
    after an optional block the model opens itself ("may"), or at once ("": no reasoning parser, or the
    template closed the block, as Qwen3's does for enable_thinking=False). A harmony prompt (gpt-oss's, ending
    in an open assistant header) is "harmony" whatever the parser: an optional analysis message, then the answer
    as a message of its own."""
    if prompt.endswith(HARMONY_PROMPT_END):
        return "harmony"
    if not reasoning_parser:
        return ""
    opened = prompt.rfind("<think>")
    if opened >= 0 and prompt.find("</think>", opened) < 0:
        return "open"
    return "" if prompt.rstrip().endswith("</think>") else "may"


def with_reasoning(grammar: Grammar, think: str, added: Mapping[str, int]) -> Grammar:
    """Put the free-text reasoning block in front of the answer's grammar: any bytes, then </think> (the
    added token when the vocabulary has one) and up to four newlines or spaces."""
    if not think:
        return grammar
    open_tag, close_tag = (Token(added[text]) if text in added else lit(text) for text in ("<think>", "</think>"))
    block = seq(Repeat(ANY_BYTE, 0, None), close_tag, Repeat(byte_set([(0x0A, 0x0A), (0x20, 0x20)]), 0, 4))
    prefix = block if think == "open" else Repeat(seq(open_tag, block), 0, 1)
    rules = dict(grammar.rules)
    rules["__reasoning_root"] = seq(prefix, Ref(grammar.start))
    return Grammar(rules, "__reasoning_root")


def with_harmony_channels(grammar: Grammar, added: Mapping[str, int], is_call: bool) -> Grammar:
    """gpt-oss's turn around a constrained answer: `<|channel|>analysis<|message|>…<|end|><|start|>assistant` at
    most once (free text, as the model reasons), then the answer: a forced call writes its own header (the
    commentary channel to functions.NAME); any other answer goes in the final channel. Markers by id when the
    vocabulary has them."""
    mark = {m: Token(added[m]) if m in added else lit(m) for m in HARMONY_MARKERS}
    analysis = seq(mark["<|channel|>"], lit("analysis"), mark["<|message|>"], Repeat(ANY_BYTE, 0, None),
                   mark["<|end|>"], mark["<|start|>"], lit("assistant"))
    head = () if is_call else (mark["<|channel|>"], lit("final"), mark["<|message|>"])
    rules = dict(grammar.rules)
    rules["__reasoning_root"] = seq(Repeat(analysis, 0, 1), *head, Ref(grammar.start))
    return Grammar(rules, "__reasoning_root")


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What building a grammar needs of the tokenizer (small and picklable, for the compile worker): the added
    tokens, text -> id, which a grammar matches by id and never by spelling them; and the size a token reference
    (GBNF `<[id]>`) must stay under."""
    added: Mapping[str, int]
    size: int


def vocabulary_of(tokenizer: Tokenizer) -> Vocabulary:
    added = {text: i for i in sorted(tokenizer.added_token_ids) if (text := tokenizer.id_to_token(i)) is not None}
    return Vocabulary(added, tokenizer.vocab_size)


def build_grammar(spec: GuidedSpec, vocab: Vocabulary) -> Grammar:
    """The spec as a grammar (GrammarError if it cannot be one), after any reasoning block. A grammar that
    names the reasoning tags itself (a GBNF `<think> … </think>`) already says how reasoning goes: as is."""
    grammar = _answer_grammar(spec, vocab)
    if not spec.think:  # nothing goes in front: no walk of the grammar for tags (nested20's ~650 nodes)
        return grammar
    added = vocab.added
    tags = {added[t] for t in ("<think>", "</think>") if t in added}
    if tags and any(t in tags for node in grammar.rules.values() for t in iter_tokens(node)):
        return grammar
    if spec.think == "harmony":
        return grammar if spec.kind == "grammar" else with_harmony_channels(grammar, added, spec.kind == "tools")
    return with_reasoning(grammar, spec.think, added)


def compile_spec(spec: GuidedSpec, vocab: Vocabulary) -> CompiledGrammar:
    """build_grammar, then the NFA: what the compile worker runs."""
    return compile_grammar(build_grammar(spec, vocab), spec.key)


def _answer_grammar(spec: GuidedSpec, vocab: Vocabulary) -> Grammar:
    added = vocab.added
    if spec.kind == "json":
        return schema_to_grammar(json.loads(spec.text))
    if spec.kind == "json_object":
        return json_object_grammar()
    if spec.kind == "regex":
        return Grammar({"root": parse_regex(spec.text)})
    if spec.kind == "choice":
        return Grammar({"root": alt(*(lit(c) for c in json.loads(spec.text)))})
    if spec.kind == "grammar":
        grammar = parse_gbnf(spec.text, added.get)  # checked there (check_grammar)
        for node in grammar.rules.values():
            for token_id in iter_tokens(node):
                if not 0 <= token_id < vocab.size:
                    raise GrammarError(f"token <[{token_id}]> is outside the vocabulary (size {vocab.size})")
        return grammar
    style, parallel, tools = json.loads(spec.text)
    open_tag, close_tag = (Token(added[text]) if text in added else lit(text)
                           for text in ("<tool_call>", "</tool_call>"))
    return tool_call_grammar([(name, json.loads(params) if params else None) for _, name, params in tools],
                             indices=[index for index, _, _ in tools],
                             style=style, parallel=parallel, open_tag=open_tag, close_tag=close_tag,
                             markers={m: Token(added[m]) for m in HARMONY_CALL_MARKERS if m in added})


class GrammarCache:
    """Compiled grammars by spec, least recently used dropped first. One per server.

    Misses compile in spawned worker processes, not a thread: the compile is pure Python and holds the GIL,
    and from a thread a 300-property schema stalled every stream for half a second. The front ends refuse a
    grammar over their limits as they build it (in well under a second); what is left runs under a deadline
    (`compile_timeout_s`), past which its process is killed and replaced. Two processes by default, so one slow
    compile does not hold up the others, and requests for a grammar already compiling wait for that compile.
    """

    def __init__(self, tokenizer: Tokenizer, capacity: int = CACHE_SIZE, *,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S, num_workers: int = COMPILE_WORKERS) -> None:
        self.vocab = vocabulary_of(tokenizer)
        self.capacity = capacity
        self.compile_timeout_s = compile_timeout_s
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._compiling: dict[str, asyncio.Task] = {}
        self.workers = CompileWorkers(compile_spec, num_workers, compile_timeout_s)
        self.hits = self.misses = 0

    def close(self) -> None:
        """Stop the compile workers (a compile in progress fails); a later miss starts new ones."""
        for task in self._compiling.values():
            task.cancel()
        self.workers.close()

    async def get(self, spec: GuidedSpec) -> CompiledGrammar:
        compiled = self._compiled.get(spec.key)
        if compiled is not None:
            self.hits += 1
            self._compiled.move_to_end(spec.key)
            return compiled
        task = self._compiling.get(spec.key)
        if task is None:
            self.misses += 1
            task = asyncio.get_running_loop().create_task(self._compile(spec))
            self._compiling[spec.key] = task
            task.add_done_callback(lambda t, key=spec.key: self._compile_done(key, t))
        try:  # shielded: a client that leaves does not cancel a compile others may be waiting for
            return await asyncio.shield(task)
        except GrammarError as error:  # each waiter names its own field: the key does not include it
            param = error.param or spec.param
            raise APIError(400, f"Invalid {param}: {error}", param=param) from None
        except RecursionError:
            raise APIError(400, f"Invalid {spec.param}: it is nested too deeply.", param=spec.param) from None
        except CallTimedOut:
            # A 400, not a 503: the deadline counts the compile alone (not the wait for a worker), so the same
            # grammar would run out of time again, and SDKs that retry 5xx (openai's does, twice) would only
            # repeat the work. vLLM and OpenAI answer a grammar too complex to build with a 400 as well.
            raise APIError(400, f"Invalid {spec.param}: it did not compile within {self.compile_timeout_s:g} s "
                                "and was stopped; make it smaller (fewer alternatives, properties or enum "
                                "values, lower repeat counts or lengths).", param=spec.param) from None
        except WorkersBusy as error:  # overload: worth a retry later
            raise APIError(503, f"The server is overloaded: grammar compiles are queued ({error}).",
                           code="overloaded") from None
        except WorkerDied as error:
            raise APIError(500, f"Compiling {spec.param} failed: the compile worker died ({error}).",
                           code="internal_error") from None

    async def _compile(self, spec: GuidedSpec) -> CompiledGrammar:
        # In a worker even when short: `.{0,9999}` is short text and a large automaton.
        compiled = await self.workers.run(spec, self.vocab)
        self._compiled[spec.key] = compiled
        # Counted on each miss rather than kept beside the cache (at most `capacity` grammars to add up).
        while len(self._compiled) > 1 and (len(self._compiled) > self.capacity or sum(
                c.num_states for c in self._compiled.values()) > MAX_CACHED_STATES):
            self._compiled.popitem(last=False)
        return compiled

    def _compile_done(self, key: str, task: asyncio.Task) -> None:
        if self._compiling.get(key) is task:
            del self._compiling[key]
        if not task.cancelled():
            task.exception()  # retrieved: its waiters have it, or none is left to care
