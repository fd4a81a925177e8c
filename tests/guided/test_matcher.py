"""Token masks against a brute-force reference, state by state, and the automaton against the slow matcher."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from rawserve.engine.guided.automaton import DEAD, Automaton
from rawserve.engine.guided.grammar import (ANY_CHAR, EMPTY, TOKEN_BASE, Grammar, GrammarError, Ref, Repeat, Token,
                                            accepts, alt, byte_set, codepoint_ranges, lit, seq)
from rawserve.engine.guided.matcher import GrammarRuntime, GuidedRegistry, GuidedState
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.vocab import VocabIndex

DIGIT = byte_set([(48, 57)])
STRING_CHAR = alt(codepoint_ranges([(0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF)]),
                  seq(lit("\\"), byte_set([(ord(c), ord(c)) for c in '"\\/bfnrt'])))
JSON_STRING = seq(lit('"'), Repeat(STRING_CHAR, 0, None), lit('"'))


def small_vocab(seed: int = 0) -> tuple[list[bytes], set[int]]:
    """Every single byte, pieces of JSON, multi-byte characters split at every point, random words,
    a duplicate, and three special tokens."""
    rng = random.Random(seed)
    tokens = [bytes([b]) for b in range(256)]
    tokens += [t.encode() for t in ('{"', '":', '", "', '"}', "}}", '"]}', '"},{"', "true", "null", "12", "-0",
                                    " {", "ab", "abc", "(", "()", "((", "))", "é", "中文", "😀", "\\\"", "\\n")]
    for char in ("é", "中", "😀"):
        raw = char.encode()
        tokens += [raw[:i] for i in range(2, len(raw))] + [raw[i:] for i in range(1, len(raw))]
    letters = b'abc{}[]",:0123456789 \\'
    tokens += [bytes(rng.choice(letters) for _ in range(rng.randint(2, 6))) for _ in range(300)]
    tokens.append(b"ab")  # same bytes as an earlier token
    specials = {len(tokens), len(tokens) + 1, len(tokens) + 2}
    tokens += [b"<s>", b"</s>", b"<tool_call>"]
    return tokens, specials


# the closure as the automaton defines it, held apart from Automaton._closure, which tests count calls of
_CLOSURE = Automaton._closure


def reference_step(a: Automaton, threads: frozenset[tuple[int, int]], byte: int) -> frozenset[tuple[int, int]]:
    """The threads after `byte`, read off the NFA's edges and closed: no configuration interned, no row or step the
    automaton kept is read, so the masks and walks under test (and step_bytes) cannot bend the reference."""
    moved = []
    for s, sid in threads:
        if s == a.mark:  # a MARK frame's state takes any byte, forever
            moved.append((s, sid))
        else:
            moved += [(t, sid) for lo, hi, t in a.g.byte_edges[s] if lo <= byte <= hi]
    return _CLOSURE(a, moved) if moved else frozenset()


def brute_mask(automaton: Automaton, vocab: VocabIndex, cid: int) -> torch.Tensor:
    """Every token whose bytes reference_step leads through alive, and the special tokens some thread takes."""
    ref = torch.zeros(vocab.vocab_size, dtype=torch.bool)
    start = automaton.configs[cid]
    stepped: dict[tuple[frozenset, int], frozenset] = {}  # tokens share their prefixes
    for t, data in enumerate(vocab.token_bytes):
        if not data or t in vocab.special_set:
            continue
        threads = start
        for byte in data:
            key = (threads, byte)
            nxt = stepped.get(key)
            if nxt is None:
                nxt = stepped[key] = reference_step(automaton, threads, byte)
            threads = nxt
            if not threads:
                break
        else:
            ref[t] = True
    for s, sid in start:
        if s != automaton.mark:
            for t, target in automaton.g.token_edges[s]:
                if _CLOSURE(automaton, [(target, sid)]):
                    ref[t] = True
    return ref


GRAMMARS = {
    "object": Grammar({"root": seq(lit('{"a": '), JSON_STRING, lit(', "b": '), alt(lit("true"), lit("null")),
                                   lit("}"))}),
    "digits": Grammar({"root": seq(DIGIT, Repeat(DIGIT, 2, 2), lit("-"), Repeat(DIGIT, 4, 4))}),
    "parens": Grammar({"root": alt(seq(lit("("), Ref("root"), lit(")")), EMPTY)}),
    "nested": Grammar({"value": alt(JSON_STRING, Ref("obj"), Ref("arr"), lit("12")),
                       "obj": seq(lit("{"), Repeat(seq(JSON_STRING, lit(":"), Ref("value")), 0, 1), lit("}")),
                       "arr": seq(lit("["), Repeat(seq(Ref("value"), Repeat(seq(lit(","), Ref("value")), 0, None)),
                                                   0, 1), lit("]")),
                       "root": Ref("obj")}),
    "unicode": Grammar({"root": Repeat(codepoint_ranges([(0xE9, 0xE9), (0x4E00, 0x9FFF), (0x1F600, 0x1F64F)]), 0,
                                       3)}),
    "tool": Grammar({"root": seq(Token(-1), lit("\n{}\n"))}),  # token id patched below
}


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_masks_equal_brute_force_in_every_reachable_state(name):
    tokens, specials = small_vocab()
    vocab = VocabIndex(tokens, specials, len(tokens) + 5)  # 5 padding ids, never allowed
    grammar = GRAMMARS[name]
    if name == "tool":
        grammar = Grammar({"root": seq(Token(max(specials)), lit("\n{}\n"))})
    runtime = GrammarRuntime(compile_grammar(grammar, name), vocab)
    a = runtime.automaton
    seen = {a.start}
    frontier = [a.start]
    checked = 0
    while frontier and checked < 150:
        cid = frontier.pop(0)
        mask = runtime.mask(cid).allowed(vocab.vocab_size)
        assert torch.equal(mask, brute_mask(a, vocab, cid)), f"config {cid}"
        assert not mask[-5:].any()
        checked += 1
        for t in mask.nonzero().squeeze(1).tolist():
            nxt = runtime.advance(cid, t)
            assert nxt != DEAD
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert checked > 3


def test_special_tokens_are_allowed_only_where_the_grammar_names_them():
    tokens, specials = small_vocab()
    vocab = VocabIndex(tokens, specials, len(tokens))
    tool = max(specials)
    runtime = GrammarRuntime(compile_grammar(Grammar({"root": seq(Token(tool), lit("x"))}), "t"), vocab)
    first = runtime.mask(runtime.start).allowed(vocab.vocab_size)
    assert first.nonzero().squeeze(1).tolist() == [tool]
    # the same text spelled in bytes is not the token
    assert runtime.advance(runtime.start, tokens.index(b"<")) == DEAD
    free = GrammarRuntime(compile_grammar(Grammar({"root": Repeat(ANY_CHAR, 0, None)}), "any"), vocab)
    allowed = free.mask(free.start).allowed(vocab.vocab_size)
    assert not allowed[sorted(specials)].any()
    assert allowed[tokens.index(b"<")]


def test_eos_is_kept_only_where_the_grammar_may_end():
    tokens, specials = small_vocab()
    eos = min(specials)
    vocab = VocabIndex(tokens, specials, len(tokens))
    runtime = GrammarRuntime(compile_grammar(Grammar({"root": Repeat(lit("ab"), 1, 2)}), "ab"), vocab)
    logits = torch.zeros(vocab.vocab_size)
    runtime.mask(runtime.start).apply(logits, [eos])
    assert logits[eos] == float("-inf")
    after = runtime.advance(runtime.start, tokens.index(b"ab"))
    logits = torch.zeros(vocab.vocab_size)
    runtime.mask(after).apply(logits, [eos])
    assert logits[eos] == 0 and logits[tokens.index(b"ab")] == 0 and logits[tokens.index(b"b")] == float("-inf")
    done = runtime.advance(after, tokens.index(b"ab"))
    assert runtime.automaton.is_complete[done]


def test_wide_mask_bans_and_narrow_mask_allows_give_the_same_logits():
    tokens, specials = small_vocab()
    vocab = VocabIndex(tokens, specials, len(tokens))
    for grammar in (Grammar({"root": Repeat(ANY_CHAR, 0, None)}), Grammar({"root": lit("abc")})):
        runtime = GrammarRuntime(compile_grammar(grammar, "g"), vocab)
        mask = runtime.mask(runtime.start)
        logits = torch.randn(vocab.vocab_size)
        expected = torch.where(mask.allowed(vocab.vocab_size), logits, torch.tensor(float("-inf")))
        mask.apply(logits, [])
        assert torch.equal(logits, expected)
    assert GrammarRuntime(compile_grammar(Grammar({"root": Repeat(ANY_CHAR, 0, None)}), "w"),
                          vocab).mask(0).is_allow_list  # the dead configuration allows nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_masks_built_for_a_gpu_do_not_wait_for_its_queued_work_and_equal_the_cpus():
    """The helper thread builds masks while the step's forward runs on the GPU: placing a new mask's ids there must
    not wait for that work (a copy from pageable memory would), and the masks equal the CPU's."""
    tokens, specials = small_vocab()
    vocab = VocabIndex(tokens, specials, len(tokens))
    on_cpu = GrammarRuntime(compile_grammar(GRAMMARS["nested"], "nested"), vocab)
    on_gpu = GrammarRuntime(compile_grammar(GRAMMARS["nested"], "nested"), vocab, "cuda")
    cids = [on_cpu.start]
    for text in (b'{', b'{"a', b'{"a":', b'{"a":[', b'{"a":["b",'):  # the same configurations on both
        cids.append(on_cpu.automaton.step_bytes(on_cpu.start, text))
        assert cids[-1] != DEAD and on_gpu.automaton.step_bytes(on_gpu.start, text) == cids[-1]
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # ~2 s of the GPU's clock: the step's forward
    queued = torch.cuda.Event()
    queued.record()
    masks = [on_gpu.mask(cid) for cid in cids]
    assert not queued.query(), "a mask build waited for the work queued on the GPU"
    torch.cuda.synchronize()
    for cid, mask in zip(cids, masks):
        assert mask.ids.is_cuda
        assert torch.equal(mask.allowed(vocab.vocab_size), on_cpu.mask(cid).allowed(vocab.vocab_size)), cid


def test_automaton_agrees_with_the_reference_matcher_on_a_recursive_grammar():
    rules = {"root": Ref("expr"),
             "expr": seq(Ref("term"), Repeat(seq(byte_set([(43, 43), (45, 45)]), Ref("term")), 0, None)),
             "term": alt(Repeat(DIGIT, 1, None), seq(lit("("), Ref("expr"), lit(")")))}
    grammar = Grammar(rules)
    a = Automaton(compile_grammar(grammar, "expr"))
    for n in range(1, 7):
        for chars in itertools.product("1+()", repeat=n):
            text = "".join(chars)
            assert a.matches(text.encode()) == accepts(grammar, text), text


def test_right_recursion_does_not_grow_the_stack():
    a = Automaton(compile_grammar(Grammar({"root": alt(seq(lit("a"), Ref("root")), lit("b"))}), "r"))
    assert a.matches(b"a" * 5000 + b"b")
    assert len(a.stacks) == 2  # the empty stack and the MARK frame: no frame per "a"


def test_nesting_past_the_stack_limit_is_refused_not_crashed():
    a = Automaton(compile_grammar(GRAMMARS["parens"], "p"))
    assert a.matches(b"(" * 100 + b")" * 100)
    assert not a.matches(b"(" * 200 + b")" * 200)


def test_special_tokens_in_symbol_input():
    a = Automaton(compile_grammar(Grammar({"root": seq(Token(7), Repeat(DIGIT, 1, None), Token(8))}), "s"))
    assert a.matches((TOKEN_BASE + 7, 49, 50, TOKEN_BASE + 8))
    assert not a.matches((TOKEN_BASE + 7, TOKEN_BASE + 8))


def test_oversized_grammar_is_refused():
    with pytest.raises(GrammarError, match="too large"):
        compile_grammar(Grammar({"root": Repeat(ANY_CHAR, 0, 100_000)}), "big")


def test_registry_shares_one_runtime_per_grammar_and_drops_the_oldest():
    tokens, specials = small_vocab()
    registry = GuidedRegistry(VocabIndex(tokens, specials, len(tokens)), capacity=2)
    compiled = [compile_grammar(Grammar({"root": lit(t)}), t) for t in ("a", "b", "c")]
    first = registry.state_for(compiled[0])
    assert registry.state_for(compiled[0]).runtime is first.runtime
    registry.state_for(compiled[1])
    registry.state_for(compiled[2])
    assert registry.state_for(compiled[0]).runtime is not first.runtime
    state = GuidedState(first.runtime)
    state.advance(tokens.index(b"a"))
    assert state.is_complete and not state.is_dead


def test_a_pickled_grammar_behaves_like_the_original():
    import pickle

    grammar = GRAMMARS["nested"]
    compiled = compile_grammar(grammar, "nested")
    copy = pickle.loads(pickle.dumps(compiled))
    a, b = Automaton(compiled), Automaton(copy)
    for text in ('{}', '{"a":12}', '{"a":{"b":[12,"x",[]]}}', '{"a":', '{"a":[12,]}', '[]'):
        assert a.matches(text.encode()) == b.matches(text.encode()) == accepts(grammar, text), text


def test_mask_caches_past_their_byte_bound_are_dropped_and_rebuilt_equal(monkeypatch):
    import rawserve.engine.guided.matcher as matcher

    tokens, specials = small_vocab()
    vocab = VocabIndex(tokens, specials, len(tokens))
    runtime = GrammarRuntime(compile_grammar(GRAMMARS["nested"], "nested"), vocab)
    first = runtime.mask(runtime.start).allowed(vocab.vocab_size)
    monkeypatch.setattr(matcher, "MAX_CACHE_BYTES", 0)
    cid = runtime.advance(runtime.start, tokens.index(b"{"))
    runtime.mask(cid)  # over the bound: the caches were cleared before this build
    assert runtime.start not in runtime._masks and runtime.cache_bytes > 0
    assert torch.equal(runtime.mask(runtime.start).allowed(vocab.vocab_size), first)


def test_a_grammar_past_its_configuration_bound_stops_growing(monkeypatch):
    import rawserve.engine.guided.matcher as matcher

    tokens, specials = small_vocab()
    vocab = VocabIndex(tokens, specials, len(tokens))
    runtime = GrammarRuntime(compile_grammar(GRAMMARS["parens"], "parens"), vocab)
    monkeypatch.setattr(matcher, "MAX_CONFIGS", runtime.automaton.num_configs + 5)
    cid = runtime.start
    for _ in range(40):  # each "(" is a new configuration (a deeper stack)
        cid = runtime.advance(cid, tokens.index(b"("))
        if cid == DEAD:
            break
    assert cid == DEAD and runtime.automaton.num_configs <= matcher.MAX_CONFIGS + 260
    assert runtime.mask(DEAD).num_allowed == 0  # the request can only end


def plain_vocab() -> tuple[list[bytes], set[int]]:
    """small_vocab plus what the plain-character shortcut splits: tokens longer than PLAIN_MAX_CHARS, plain
    runs ending in `"` or an escape or a partial character, escapes followed by plain text."""
    tokens, specials = small_vocab(1)
    rng = random.Random(7)
    words = ["a", "é", "中", "😀", " ", "x", "7"]
    extra = []
    for _ in range(200):
        run = "".join(rng.choice(words) for _ in range(rng.randint(1, 24))).encode()
        tail = rng.choice([b"", b'"', b'",', b'"}', b"\\n", b"\\u00e9", "中".encode()[:2], b"\n", b'\\"a'])
        extra.append(run + tail)
    extra += [b'\\nab', b'"', b'",', b"a" * 30, "é".encode() * 20 + b'"']
    base = len(tokens) - len(specials)  # specials are the last three: keep them last
    tokens = tokens[:base] + extra + tokens[base:]
    return tokens, {i + len(extra) for i in specials}


PLAIN_GRAMMARS = {
    "unbounded": Grammar({"root": seq(lit('{"a": '), JSON_STRING, lit("}"))}),
    "max_length": Grammar({"root": seq(lit('["'), Repeat(STRING_CHAR, 0, 20), lit('"]'))}),
    "min_max_length": Grammar({"root": seq(lit('"'), Repeat(STRING_CHAR, 3, 5), lit('", "'),
                                           Repeat(STRING_CHAR, 0, 2), lit('"'))}),
    # not every plain character moves alike: the general walk
    "letters": Grammar({"root": seq(lit('"'), Repeat(byte_set([(97, 122)]), 0, None), lit('"'))}),
}


@pytest.mark.parametrize("name", sorted(PLAIN_GRAMMARS))
def test_plain_character_shortcut_masks_equal_brute_force(name):
    tokens, specials = plain_vocab()
    vocab = VocabIndex(tokens, specials, len(tokens) + 2)
    runtime = GrammarRuntime(compile_grammar(PLAIN_GRAMMARS[name], name), vocab)
    a = runtime.automaton
    rng = random.Random(3)
    seen, frontier, checked = {a.start}, [a.start], 0
    while frontier and checked < 120:
        cid = frontier.pop(rng.randrange(len(frontier)))
        mask = runtime.mask(cid).allowed(vocab.vocab_size)
        assert torch.equal(mask, brute_mask(a, vocab, cid)), f"{name}: configuration {cid}"
        checked += 1
        for t in mask.nonzero().squeeze(1).tolist():
            nxt = runtime.advance(cid, t)
            if nxt != DEAD and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert checked >= 3
    if name == "letters":
        assert runtime.num_walks["plain"] == 0
    else:
        assert runtime.num_walks["plain"] > 0
