"""The JSON string lexeme's shared token sets (engine/guided/lexemes.py): the sets against the lexer token by
token, and masks that use them against the brute-force reference, at every depth a string appears."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.guided.automaton import DEAD, UNEXPANDED
from rawserve.engine.guided.grammar import Grammar, Ref, Repeat, alt, byte_set, lit, seq
from rawserve.engine.guided.json_schema import json_object_grammar, schema_to_grammar
from rawserve.engine.guided.json_strings import CHAR, STRING_BODY
from rawserve.engine.guided.counted_tail import counted_tokens
from rawserve.engine.guided.lexemes import (SHIFT_SPARE, LexemeWalk, StringLexeme, opening_quotes, pairing_cut,
                                            prepare_string_lexemes, string_lexeme, string_lexer)
from rawserve.engine.guided.matcher import GrammarRuntime
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.vocab import VocabIndex
from tests.guided.test_matcher import JSON_STRING, brute_mask, plain_vocab


# A JSON string spelled inline, quotes and all, as a GBNF grammar may (the compilers call one body rule instead)
STRING = seq(lit('"'), Repeat(CHAR, 0, None), lit('"'))


def lexeme_vocab() -> tuple[list[bytes], set[int]]:
    """plain_vocab plus what a string's tokens look like around the lexeme: escapes split anywhere (`\\u00`),
    surrogate pairs, quotes then structure, controls, and openings of strings inside tokens (`{"`, ` "ab`)."""
    tokens, specials = plain_vocab()
    extra = [b"\\u00e9", b"\\u", b"\\u00", b"\\ud83d\\ude00", b"\\ud83d", b"\\ude00", b'a\\"b', b'\\\\', b'x"',
             b'x": "', b'"x', b' "ab', b' "a\\n', b'{"k": "v', b'"},{"', b'": 1, "', b'"\t', b'a\x01', b'"]]}',
             "é\"".encode(), "中".encode()[:1], b'\\/', b'\\x', b'ab\\u12']
    base = len(tokens) - len(specials)
    return tokens[:base] + extra + tokens[base:], {i + len(extra) for i in specials}


@pytest.fixture(scope="module")
def vocab() -> VocabIndex:
    tokens, specials = lexeme_vocab()
    return VocabIndex(tokens, specials, len(tokens) + 3)  # 3 padding ids, never allowed


def test_sets_agree_with_the_lexer_token_by_token_from_every_state(vocab):
    """From a character boundary (read densely) and from inside a character or an escape (read sparsely)."""
    lexer = string_lexer()
    states = [s for s in range(1, lexer.num_states) if s != lexer.close]
    assert lexer.start in states and len(states) > 20
    for first in states:
        lexeme = StringLexeme(vocab, first)
        listed = set(lexeme.ids.tolist())
        inside = set(range(vocab.vocab_size)) - listed if lexeme.is_ban_list else listed
        closes: dict[int, bytes] = {}  # token -> its bytes after the closing quote, read off the close trie
        work = [(0, b"")]
        while work:
            node, rest = work.pop()
            for token_id in lexeme.close_tokens[node]:
                closes[token_id] = rest
            work += [(child, rest + bytes([byte])) for byte, child in lexeme.close_children[node].items()]
        for token_id, data in enumerate(vocab.token_bytes):
            state, closed_rest = first, None
            for i, byte in enumerate(data):
                state = lexer.rows[state][byte]
                if state == lexer.close:
                    closed_rest = data[i + 1:]
                    break
                if state == DEAD:
                    break
            is_token = bool(data) and token_id not in vocab.special_set
            assert (token_id in inside) == (is_token and closed_rest is None and state != DEAD), (first, data)
            assert closes.get(token_id) == (closed_rest if is_token else None), (first, token_id, data)
        if first == lexer.start:
            assert len(closes) > 20 and lexeme.num_inside > 200 and lexeme.is_ban_list


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "inner": {"type": "object", "properties": {"note": {"type": "string"}, "code": {"type": "string", "maxLength": 3},
                                               "kind": {"enum": ["a", "b\"c"]}},
              "required": ["note"]},
}, "required": ["name", "tags", "inner"]}

GRAMMARS = {
    "json_object": json_object_grammar(),
    "schema": schema_to_grammar(SCHEMA),
    "top_level": Grammar({"root": seq(lit('{"a": '), STRING, lit(', "b": ['), STRING, lit("]}"))}),
}
# a text of each grammar, walked byte by byte so strings at every depth are reached
TEXTS = {
    "json_object": '{"a": {"b\\n": [{"c": "x\\u00e9\\"", "d": ["é中😀", {"e": "\\ud83d\\ude00"}]}], "f": "g"}}',
    "schema": '{"name": "n\\"ab", "tags": ["x", "中"], "inner": {"note": "é", "code": "a\\nb", "kind": "b\\"c"}}',
    "top_level": '{"a": "p\\tq", "b": ["r"]}',
}


def check_every_place(runtime: GrammarRuntime, vocab: VocabIndex, text: str) -> int:
    """Masks equal brute force along `text`, stepped one byte token at a time, and at the configurations its
    masks allow one token on (where tokens end inside strings, after quotes, mid-escape). -> configurations."""
    a = runtime.automaton
    byte_token = {vocab.token_bytes[t][0]: t for t in range(len(vocab.token_bytes))
                  if len(vocab.token_bytes[t]) == 1 and t not in vocab.special_set}
    cid = a.start
    seen: set[int] = set()
    for byte in list(text.encode()) + [None]:
        mask = runtime.mask(cid).allowed(vocab.vocab_size)
        assert torch.equal(mask, brute_mask(a, vocab, cid)), cid
        seen.add(cid)
        for t in mask.nonzero().squeeze(1).tolist()[::7]:
            nxt = runtime.advance(cid, t)
            if nxt not in seen:
                seen.add(nxt)
                assert torch.equal(runtime.mask(nxt).allowed(vocab.vocab_size), brute_mask(a, vocab, nxt)), nxt
        if byte is None:
            break
        cid = runtime.advance(cid, byte_token[byte])
        assert cid != DEAD
    assert a.is_accepting[cid]
    return len(seen)


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_masks_that_take_the_lexeme_sets_equal_brute_force(vocab, name):
    runtime = GrammarRuntime(compile_grammar(GRAMMARS[name], name), vocab)
    assert check_every_place(runtime, vocab, TEXTS[name]) > 30
    assert runtime.num_walks["lexeme"] >= 2  # string bodies took the lexeme's sets, not a walk
    assert runtime._lexeme.num_below >= 1  # and a narrow walk took those below an opening quote


def test_a_string_rule_is_proven_once_at_every_depth(vocab):
    """json_object's strings are one rule at every depth: the pairing is run for its cut, not per depth, so a
    deeper output matches more configurations with no more pairings."""
    runs = []
    for depth in (2, 6):
        runtime = GrammarRuntime(compile_grammar(json_object_grammar(), f"deep{depth}"), vocab)
        check_every_place(runtime, vocab, '{"a": ' * depth + '"x"' + "}" * depth)
        lexeme = runtime._lexeme
        runs.append((sum(1 for matched in lexeme._matched.values() if matched is not None), lexeme.num_proven))
    (shallow_matched, shallow_proven), (deep_matched, deep_proven) = runs
    assert deep_matched > shallow_matched and deep_proven == shallow_proven


def test_json_objects_strings_pair_once(vocab):
    """json_object's strings (values, first keys, later keys, at every depth) call one body rule
    (SchemaCompiler.plain_string), as a schema's plain strings do: one pairing, where its three inlined copies
    paired three times in each new grammar's first pass."""
    runtime = GrammarRuntime(compile_grammar(json_object_grammar(), "one_body"), vocab)
    check_every_place(runtime, vocab, '{"a": "x", "b": {"c": "y", "d": ["z", "w"]}, "e": "v"}')
    assert runtime._lexeme.num_paired == 1 and runtime.num_walks["lexeme"] >= 4


def inlined_strings_grammar() -> Grammar:
    """json_object's rules with their strings inlined (STRING where it calls the body rule, as a GBNF grammar may
    spell them): the first-level keys and values on the empty stack, a nested object's on stacks."""
    member = seq(STRING, lit(": "), Ref("value"))
    return Grammar({"value": alt(Ref("object"), STRING),
                    "object": seq(lit("{"), member, Repeat(seq(lit(", "), member), 0, None), lit("}")),
                    "root": Ref("object")}, "root")


def test_a_top_level_string_and_a_deeper_one_share_one_pairing(vocab):
    """A string inlined in a rule is on the empty stack at the first level and on stacks below it: the pairing proven
    on the top-level configurations is kept under the deeper ones' cut (pairing_cut, LexemeWalk.match), so strings
    nested below them pair nothing more (3 pairings for both texts, one per inlined copy)."""
    runs = []
    for text in ('{"a": "x", "b": "y"}', '{"a": {"b": {"c": "x"}, "d": "y"}}'):
        runtime = GrammarRuntime(compile_grammar(inlined_strings_grammar(), f"top{len(text)}"), vocab)
        check_every_place(runtime, vocab, text)
        a, lexeme = runtime.automaton, runtime._lexeme
        matched = [cid for cid, m in lexeme._matched.items() if m is not None]
        stacks = {pairing_cut(a, cid)[0] for cid in matched}
        runs.append((lexeme.num_paired, len(matched), 0 in stacks, len(stacks) > 1))
    (top_paired, top_matched, top_on_empty, _), (nested_paired, nested_matched, _, nested_deeper) = runs
    assert top_on_empty and nested_deeper, runs  # both kinds were asked
    assert nested_matched > top_matched and nested_paired == top_paired, runs


def test_a_place_inside_a_character_is_proven_by_its_strings_pairing(vocab, monkeypatch):
    """A string's pairing (on a stack: its cut's) walks every lexer state, and each configuration it pairs is kept as
    proven from that state (LexemeWalk._match): a place inside a character (`é` split) or an escape (after `\\`),
    at the top level or deeper, is then matched with no pairing of its own, where it failed one for each other
    state with its bytes alive and then walked the whole pairing again (this text: 4 pairings, not 98)."""
    runtime = GrammarRuntime(compile_grammar(json_object_grammar(), "inside_kept"), vocab)
    calls = []
    match = LexemeWalk._match
    monkeypatch.setattr(LexemeWalk, "_match",
                        lambda walk, cid, first, is_cut: calls.append(cid) or match(walk, cid, first, is_cut))
    check_every_place(runtime, vocab, '{"a": {"b": "x\\n\u00e9y", "c": ["\u00e9\\""]}}')
    a, lexer = runtime.automaton, string_lexer()
    inside = [cid for cid, matched in runtime._lexeme._matched.items()
              if matched is not None and matched[0] != lexer.start and pairing_cut(a, cid)[0] >= 0]
    assert len({matched for cid, matched in runtime._lexeme._matched.items() if cid in inside}) >= 3, inside
    cuts = {pairing_cut(a, cid)[1] for cid in inside}
    assert calls and not cuts.intersection(calls)
    # kept by states as an int (one thread) or a tuple of ints, which the collector untracks; never a frozenset,
    # which it tracks for good
    kept = [states for states, _ in runtime._lexeme._proven]
    assert len(kept) > 30 and any(isinstance(k, int) for k in kept)
    assert all(isinstance(k, int) or (type(k) is tuple and all(isinstance(s, int) for s in k)) for k in kept)


def test_inside_a_character_or_an_escape_the_lexeme_sets_serve_too(vocab):
    """A token that ends inside a character (`中`'s first byte) or an escape (`\\u00`) leaves the request in a
    lexer state other than the start: its mask comes from that state's sets, exactly."""
    runtime = GrammarRuntime(compile_grammar(json_object_grammar(), "mid"), vocab)
    a = runtime.automaton
    states = set()
    for prefix in ('{"a": "x', '{"a": {"b": ["'):
        body = a.step_bytes(a.start, prefix.encode())
        for piece in ("中".encode()[:1], "中".encode()[:2], b"\\", b"\\u", b"\\u00", "😀".encode()[:3]):
            cid = a.step_bytes(body, piece)
            assert torch.equal(runtime.mask(cid).allowed(vocab.vocab_size), brute_mask(a, vocab, cid)), piece
            matched = runtime._lexeme.match(a.truncate(cid, 3))
            assert matched is not None, piece
            states.add(matched[0])
    assert len(states) == 6 and string_lexer().start not in states


def test_other_string_bodies_are_not_taken_for_the_lexeme(vocab):
    """A string body the lexer does not spell (no \\u escapes) keeps its own walk, and masks stay exact."""
    grammar = Grammar({"root": seq(lit('{"a": '), JSON_STRING, lit("}"))})
    runtime = GrammarRuntime(compile_grammar(grammar, "no_unicode_escapes"), vocab)
    check_every_place(runtime, vocab, '{"a": "a\\"b"}')
    assert runtime.num_walks["lexeme"] == 0 and runtime._lexeme.num_below == 0


def test_a_short_counted_string_takes_the_lexeme_tokens_by_count(vocab):
    """A maxLength shorter than the longest token: no place has room for every token, and each takes the
    lexeme's tokens of at most the characters it has left (counted_tail), its first place and its last, where
    only the quote is left, included. Masks stay exact at every place, and no walk below an opening quote takes
    the uncounted anchored sets."""
    grammar = Grammar({"root": seq(lit('{"a": "'), Repeat(CHAR, 0, 6), lit('"}'))})
    runtime = GrammarRuntime(compile_grammar(grammar, "counted"), vocab)
    check_every_place(runtime, vocab, '{"a": "ab\\u00e9中!"}')
    tail = runtime._tail
    # too short a run for a shift to prove its places: each is paired once, for the whole chain at the first
    assert tail.num_walks >= 6 and tail.num_proven <= 7, (tail.num_walks, tail.num_proven)
    assert runtime._lexeme.num_counted == 0 and runtime._lexeme.num_below == 0
    assert tail.num_below >= 1  # below `"` and ` "` in the narrow walk before the string: by count too
    assert sorted({left for left, _ in filter(None, tail._left.values())}) == list(range(7))


@pytest.mark.parametrize("max_length", [1, 2, 3])
def test_tokens_that_open_a_short_counted_string_are_taken_by_count(vocab, max_length):
    """Below an opening quote inside a token (` "ab`, ` "a\\n`: two characters after it) a narrow walk takes the
    tokens by the characters they begin after the quote: allowed up to the bound, not past it."""
    grammar = Grammar({"root": seq(lit('{"a": "'), Repeat(CHAR, 0, max_length), lit('"}'))})
    runtime = GrammarRuntime(compile_grammar(grammar, f"open{max_length}"), vocab)
    check_every_place(runtime, vocab, '{"a": "' + "ab"[:max_length] + '"}')
    assert runtime._tail.num_below >= 1


@pytest.mark.parametrize("shape", ["top_level", "in_array", "min_length"])
def test_a_counted_string_with_room_for_every_token_takes_the_lexeme_at_its_places(vocab, shape):
    """A maxLength string's places with room for the vocabulary's longest token (and SHIFT_SPARE copies more)
    take the lexeme's sets, proven on one place a copy apart from the rest; its first place (before the run)
    too; the places nearer the end take its tokens of at most the characters left (counted_tail). Masks stay exact at every place, the string filled to
    its bound, characters of one to four bytes and escapes alike."""
    room = SHIFT_SPARE + max(map(len, vocab.token_bytes))
    n = room + 20
    body = ("ab\\n中é😀\\u00e9" * n)[:n * 2]
    chars, i = [], 0  # n characters of the body, escapes counted as one
    while len(chars) < n:
        step = 6 if body.startswith("\\u", i) else 2 if body[i] == "\\" else 1
        chars.append(body[i:i + step])
        i += step
    text = "".join(chars)
    schema = {"type": "string", "maxLength": n}
    if shape == "in_array":
        schema = {"type": "array", "items": schema}
        text = f'["x", "{text}"]'
    else:
        if shape == "min_length":
            schema = {**schema, "minLength": 2}
        text = f'"{text}"'
    runtime = GrammarRuntime(compile_grammar(schema_to_grammar(schema), f"counted-{shape}"), vocab)
    check_every_place(runtime, vocab, text)
    lexeme = runtime._lexeme
    # the places before the last `room` or so: one pairing proves the run's, a few more its first places
    tail = runtime._tail
    assert lexeme.num_counted >= 12 and lexeme.num_counted_proven <= 4 + tail.num_proven, (
        lexeme.num_counted, lexeme.num_counted_proven, tail.num_proven)
    # inside its characters (`中`, `😀`, `\u00e9` cut after each byte) too, matched at the boundary they lead to
    assert lexeme.num_counted_inside >= 12, lexeme.num_counted_inside
    # the run's last places take the lexeme's tokens by count, proven by shifting but for the last (per string: it
    # and the string's first place, before the run, are paired on their own)
    num_strings = 2 if shape == "in_array" else 1
    assert tail.num_walks >= room - 10 and tail.num_proven == 2 * num_strings, (tail.num_walks, tail.num_proven)
    # a run's first place is proven from the pairing of the string's first place, a copy on; not past required
    # copies (minLength), whose states are outside the run
    assert lexeme.num_pairings_shifted == (0 if shape == "min_length" else num_strings), lexeme.num_pairings_shifted
    # a token inside the string advances from such a place by shifting, to where its bytes step
    a = runtime.automaton
    num_shifted = 0
    for cid in list(lexeme._counted_run):
        for t in range(0, len(vocab.token_bytes), 3):
            data = vocab.token_bytes[t]
            shifted = lexeme.advance_counted(cid, data) if data and t not in vocab.special_set else None
            if shifted is not None:
                assert shifted == a.step_bytes(cid, data), (cid, data)
                num_shifted += 1
    assert num_shifted > 100


@pytest.mark.parametrize("count", [None, 3000])
def test_bare_continuation_bytes_are_refused_not_paired_without_end(vocab, count):
    """Continuation bytes alone pair with the lexer's states inside a character, and each one's end leads back to
    the same place (unbounded) or to the next of 3,000: asked as a character's end, a place is not paired inside a
    character again, where it asked the next without end (a RecursionError). Masks stay exact."""
    body = Repeat(byte_set([(0x80, 0xBF)]), count or 0, count)
    runtime = GrammarRuntime(compile_grammar(Grammar({"root": body}), f"continuation-{count}"), vocab)
    a = runtime.automaton
    cid = a.start
    for _ in range(4):
        assert torch.equal(runtime.mask(cid).allowed(vocab.vocab_size), brute_mask(a, vocab, cid))
        cid = a.step_bytes(cid, b"\x80")


@pytest.mark.parametrize("text", ["ab\\n中é", '"x'])
def test_a_runs_first_place_is_not_proven_from_a_first_place_that_closes_elsewhere(vocab, text):
    """The string's first place (before the run) also takes `"x`: its quote leads elsewhere than the run's places'
    do, so the run's first place is paired on its own (its own row read, not first's moved a copy on), and masks
    stay exact: no `"x` after a character."""
    room = SHIFT_SPARE + max(map(len, vocab.token_bytes))
    grammar = Grammar({"root": seq(lit('{"a": "'), alt(seq(Repeat(CHAR, 0, room + 20), lit('"')), lit('"x')),
                                   lit("}"))})
    runtime = GrammarRuntime(compile_grammar(grammar, "first-closes-elsewhere"), vocab)
    check_every_place(runtime, vocab, '{"a": "' + text + '"}' if text != '"x' else '{"a": ""x}')
    assert runtime._lexeme.num_pairings_shifted == 0


def _plain_strings_schema(num: int) -> dict:
    """An object of `num` plain string properties, the last one inside a nested object and an array."""
    props = {f"p{i}": {"type": "string"} for i in range(num - 1)}
    props["deep"] = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "string"}}},
                     "required": ["xs"], "additionalProperties": False}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def test_a_schemas_plain_strings_share_one_body_and_one_pairing(vocab):
    """Every plain string of a schema calls one body rule (json_strings.STRING_BODY), so the string lexeme's
    pairing is proven once for the schema, not once per property: six properties' strings cost the pairings of
    two. Masks stay exact inside and around each of them (the quote steps from each string's own stack)."""
    proven = []
    for num in (2, 6):
        grammar = schema_to_grammar(_plain_strings_schema(num))
        assert [node for node in grammar.rules.values() if node == STRING_BODY] == [STRING_BODY]
        runtime = GrammarRuntime(compile_grammar(grammar, f"plain{num}"), vocab)
        values = ", ".join(f'"p{i}": "v{i}\\"é"' for i in range(num - 1))
        check_every_place(runtime, vocab, "{" + values + ', "deep": {"xs": ["a", "\\u00e9"]}}')
        lexeme = runtime._lexeme
        proven.append((lexeme.num_proven, sum(1 for m in lexeme._matched.values() if m is not None)))
    (few_proven, few_matched), (many_proven, many_matched) = proven
    assert many_matched > few_matched and many_proven == few_proven, proven


def test_a_string_on_a_stack_is_matched_off_its_cuts_row(vocab):
    """A configuration inside a called string (json_object's, at any depth) is matched on its cut's row, shared by
    every such string: its own 256 transitions, a dozen configurations nothing else reads, are never built."""
    runtime = GrammarRuntime(compile_grammar(json_object_grammar(), "cut_row"), vocab)
    check_every_place(runtime, vocab, '{"a": {"b": ["x", {"c": "y\\n"}]}}')
    a = runtime.automaton
    on_stacks = [cid for cid, matched in runtime._lexeme._matched.items()
                 if matched is not None and a.truncate(cid, 0) != cid]
    assert len(on_stacks) >= 4
    assert all(a.next_byte[cid][0] < 0 for cid in on_stacks)  # not expanded


def test_the_sets_below_opening_quotes_are_read_at_start():
    """prepare_string_lexemes reads the sets below the opening quotes tokens begin with (`"`, ` "`, `{"`), so a
    first request's narrow walk takes them without walking a subtree; counted strings read the same ones."""
    tokens, specials = lexeme_vocab()
    fresh = VocabIndex(tokens, specials, len(tokens) + 3)  # nothing read below a quote yet
    prepare_string_lexemes(fresh)
    start = string_lexeme(fresh)
    node_byte = fresh.py_arrays()[0]
    quotes = opening_quotes(fresh)
    assert len(quotes) >= 3 and all(node_byte[q] == 0x22 for q in quotes)
    assert set(start._subtrees) == set(quotes)
    read = dict(start._subtrees)
    runtime = GrammarRuntime(compile_grammar(GRAMMARS["schema"], "quotes_at_start"), fresh)
    check_every_place(runtime, fresh, TEXTS["schema"])
    assert runtime._lexeme.num_below >= 1 and runtime._tail.num_below >= 1
    assert all(start._subtrees[q] is read[q] for q in quotes)  # taken as read at start, not walked again
    assert all(counted_tokens(fresh).anchored(q) is read[q] for q in quotes)  # one walk for both uses


def test_pairings_read_runs_without_building_rows(vocab):
    """A counted string's pairings with the lexer read the configurations inside a character run by run
    (Automaton.run_steps), building none of their rows; what a run steps to is what the row, once built, holds
    at every byte of it, and a run an edge cuts is refused (the row is read then)."""
    grammar = Grammar({"root": seq(lit('{"a": "'), Repeat(CHAR, 0, 6), lit('"}'))})
    runtime = GrammarRuntime(compile_grammar(grammar, "run_steps"), vocab)
    check_every_place(runtime, vocab, '{"a": "ab\\u00e9中!"}')
    a = runtime.automaton
    unbuilt = [c for c in range(1, a.num_configs) if a.next_byte[c][0] < 0]
    assert len(unbuilt) >= 10  # paired, walked past, never expanded
    lexer = string_lexer()
    num_read = num_refused = 0
    for c in unbuilt:
        edges = [(lo, hi) for row, _ in a._edges(c) for lo, hi, _ in row]
        for state in range(1, lexer.num_states):
            segments = lexer.segments[state]
            nexts = a.run_steps(c, segments)
            # refused exactly when some edge begins or ends inside a run (the runs tile 0-255)
            cut = any(lo not in {r_lo for r_lo, _, _ in segments} or hi not in {r_hi for _, r_hi, _ in segments}
                      for lo, hi in edges)
            assert (nexts is None) == cut, (c, state)
            if nexts is None:
                num_refused += 1
                continue
            num_read += 1
            assert a.next_byte[c][0] < 0  # still not built
            row = a.expand(c)
            assert all(row[b] == nxt for (lo, hi, _), nxt in zip(segments, nexts) for b in range(lo, hi + 1))
            a.next_byte[c] = UNEXPANDED  # as it was, for the next lexer state (its successors stay interned)
    assert num_read > 50 and num_refused > 10


@pytest.mark.parametrize("name", ["json_object", "schema"])  # top_level's walks build every row they refuse
def test_configurations_no_lexer_state_could_take_are_refused_from_their_edges(vocab, name):
    """A configuration whose byte edges cover no lexer state's alive bytes (a key's, an enum's, a number's) is refused
    without building its row, by GrammarRuntime._walk before it asks the lexeme (StringLexer.may_pair) or by
    LexemeWalk.match below an opening quote, and only such ones: the bytes a row leads on from are among its edges'
    (Automaton.edge_bytes), so what the edges refuse the row would refuse too. Masks stay exact."""
    runtime = GrammarRuntime(compile_grammar(GRAMMARS[name], f"edges_{name}"), vocab)
    check_every_place(runtime, vocab, TEXTS[name])
    a = runtime.automaton
    lexer = string_lexer()
    refused = [cid for cid, matched in runtime._lexeme._matched.items() if matched is None]
    unbuilt = [cid for cid in refused if a.next_byte[a.truncate(cid, 0)][0] < 0]
    unbuilt += [cid for cid in runtime._masks if not lexer.may_pair(a.edge_bytes(cid)) and a.next_byte[cid][0] < 0]
    assert len(unbuilt) >= 3, (len(refused), len(unbuilt))
    for cid in range(1, a.num_configs):
        covered = a.edge_bytes(cid)
        row = a.expand(cid)
        alive = sum(1 << b for b in range(256) if row[b] != DEAD)
        assert alive & ~covered == 0, cid  # every byte the row leads on from is an edge's
    for cid in unbuilt:  # built now (above): no lexer state takes the bytes its row does
        assert a.alive_runs(a.truncate(cid, 0)) not in lexer.by_alive, cid
