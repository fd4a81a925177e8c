"""The GBNF front end: llama.cpp grammars parse as llama.cpp parses them and match what they should."""
from __future__ import annotations

import pytest

from rawserve.engine.guided.gbnf import check_grammar, nullable_rules, parse_gbnf
from rawserve.engine.guided.grammar import (TOKEN_BASE, Bytes, Grammar, GrammarError, Ref, Repeat, Token,
                                            accepts, alt, iter_refs, lit, seq, symbols)
from rawserve.engine.guided.nfa import compile_grammar

ARITHMETIC = r"""
root ::= expr
expr ::= term (("+"|"-") term)*
term ::= [0-9]+ | "(" expr ")"
"""

# The shape of llama.cpp's grammars/json.gbnf: multi-line rules inside parentheses, a trailing comment,
# an empty first alternative in `ws`.
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""

LIST = r"""
# a grammar for lists
root ::= ("- " item)+
item ::= [^\n]+ "\n"
"""

CHESS = r"""
# `root` specifies the pattern for the overall output
root ::= (
    # it must start with the characters "1. " followed by a sequence
    "1. " move " " move "\n"

    # it's followed by one or more subsequent moves, numbered with one or two digits
    ([1-9] [0-9]? ". " move " " move "\n")+
)

move ::= (pawn | nonpawn | castle) [+#]?
pawn ::= [a-h] [1-8]
nonpawn ::= [NBKQR] [a-h]? [1-8]? "x"? [a-h] [1-8]
castle ::= "O-O" "-O"?
"""


def matches(text: str, doc: str | tuple[int, ...], **kw) -> bool:
    return accepts(parse_gbnf(text, **kw), doc)


@pytest.mark.parametrize(("doc", "ok"), [
    ("1", True), ("1+2", True), ("(1+2)-34", True), ("((7))", True), ("12-(3+4)+5", True),
    ("", False), ("1+", False), ("+1", False), ("()", False), ("1 + 2", False), ("(1", False),
])
def test_arithmetic_expressions(doc: str, ok: bool) -> None:
    assert matches(ARITHMETIC, doc) is ok


@pytest.mark.parametrize(("doc", "ok"), [
    ("{}", True),
    ('{"a": 1}', True),
    ('{"a": [1, -2.5, 3e4, "x\\n\\u00e9", true, false, null], "b": {"c": "é😀"}}', True),
    ('{\n  "k": [\n    {}\n  ]\n}', True),
    ('{"a\\"b": "\\\\"}', True),
    ('{"a" 1}', False),
    ("[1]", False),  # root is an object
    ('{"a": 01}', False),
    ('{"a": 1,}', False),
    ('{"a": "raw\nnewline"}', False),
    ('{"a": "\\q"}', False),
    ("{'a': 1}", False),
    ('{"a": tru}', False),
])
def test_json_grammar_documents(doc: str, ok: bool) -> None:
    assert matches(JSON_GBNF, doc) is ok


def test_list_grammar() -> None:
    assert matches(LIST, "- milk\n- eggs\n")
    assert matches(LIST, "- é 😀\n")
    assert not matches(LIST, "")
    assert not matches(LIST, "- milk")
    assert not matches(LIST, "* milk\n")
    assert not matches(LIST, "- \n")


def test_chess_grammar_with_comments_and_multiline_group() -> None:
    assert matches(CHESS, "1. e4 e5\n2. Nf3 Nc6\n3. O-O O-O-O\n")
    assert not matches(CHESS, "1. e4 e5\n")  # at least one numbered move after the first
    assert not matches(CHESS, "1. e9 e5\n2. Nf3 Nc6\n")


def test_string_escapes() -> None:
    g = r'root ::= "\x41\u00e9\U0001F600\t\n\r\\\"\[\]\-"'
    assert parse_gbnf(g).rules["root"] == lit('Aé😀\t\n\r\\"[]-')


def test_class_escapes_ranges_and_negation() -> None:
    g = r'root ::= [\x00-\x1F\]a-c-] [^\n"] .'
    assert matches(g, "\x05éx")
    assert matches(g, "]\t😀")
    assert matches(g, "-aa")
    assert not matches(g, "d\tx")
    assert not matches(g, "a\nx")
    assert not matches(g, 'a"x')
    assert not matches(g, "ab")


def test_repetition_forms() -> None:
    g = 'root ::= "a"{2} "b"{2,} "c"{1,3} "d"{ 0 , 1 } "e"?'
    assert matches(g, "aabbc")
    assert matches(g, "aabbbbcccde")
    assert not matches(g, "abbc")
    assert not matches(g, "aabc")
    assert not matches(g, "aabbcccc")
    assert not matches(g, "aabbcdd")


def test_sequence_of_literals_is_one_bytes_node_and_groups_stay_inline() -> None:
    grammar = parse_gbnf('root ::= "ab" "cd" ("e" "f")\n')
    assert grammar.rules == {"root": Bytes(b"abcdef")}
    assert parse_gbnf("root ::= x*\nx ::= \"x\"").rules["root"] == Repeat(Ref("x"), 0, None)


def test_token_references_by_id_and_by_text() -> None:
    vocab = {"<think>": 1000, "</think>": 1001}
    g = "root ::= <think> [a-z]* </think> <[7]>"
    grammar = parse_gbnf(g, token_id=vocab.get)
    assert grammar.rules["root"] == seq(Token(1000), grammar.rules["root"].items[1], Token(1001), Token(7))
    think, end, seven = TOKEN_BASE + 1000, TOKEN_BASE + 1001, TOKEN_BASE + 7
    assert accepts(grammar, (think, *symbols("hmm"), end, seven))
    assert not accepts(grammar, (*symbols("<think>hmm</think>"), seven))
    assert matches("root ::= <[42]>", (TOKEN_BASE + 42,))


def test_token_text_is_passed_with_its_angle_brackets() -> None:
    seen: list[str] = []
    parse_gbnf("root ::= <|im_end|>", token_id=lambda text: seen.append(text) or 5)
    assert seen == ["<|im_end|>"]


@pytest.mark.parametrize(("text", "ok"), [
    ('root ::=\n  "a"', True),  # the body may start on the next line
    ('root ::= "a" |\n  "b"', True),  # a newline after '|' continues the rule
    ('root ::= ( "a"\n  "b" )', True),  # newlines are free inside parentheses
    ('root ::= "a"  # a comment\nb ::= "b"', True),
    ('root ::= "a" \r\nb ::= "b"\r\n', True),
    ("\n\n# only comments first\n\nroot ::= x\n\n\nx ::= \"a\"\n", True),
    ("root ::= snake_case\nsnake_case ::= \"a\"", True),  # the README allows underscores in names
    ("root ::=", True),  # an empty rule matches the empty string
])
def test_whitespace_and_newlines_as_llama_cpp(text: str, ok: bool) -> None:
    assert parse_gbnf(text).start == "root"


def test_empty_alternatives() -> None:
    g = 'root ::= "x" ws "y"\nws ::= | " " | "\\n"'
    assert matches(g, "xy") and matches(g, "x y") and matches(g, "x\ny")
    assert "ws" in nullable_rules(parse_gbnf(g))


@pytest.mark.parametrize(("text", "names"), [
    # syntax
    ('root ::= "a"\n  "b"', ["line 2", "expecting a rule name"]),  # a new line outside () ends the rule
    ('root ::= "a"\n| "b"', ["line 2"]),
    ('root "a"', ["line 1", "'::='", "'root'"]),
    ('root ::= "abc', ["line 1", "unterminated string", "'root'"]),
    ('root ::= "a"\nx ::= "\\q"', ["line 2", "unknown escape", "\\q", "'x'"]),
    ('root ::= "\\x4"', ["hex digits"]),
    ('root ::= [a-z', ["unterminated character class"]),
    ("root ::= []", ["empty character class"]),
    ("root ::= [z-a]", ["out of order", "'z-a'"]),
    ('root ::= ("a"\n\n', ["line 1", "expecting ')'", "'root'"]),
    ('root ::= "a")', ["unbalanced ')'"]),
    ('root ::= "a" @', ["unexpected '@'", "'root'"]),
    ("root ::= *", ["no preceding item", "'root'"]),
    ("root ::= \"a\" | +", ["no preceding item"]),
    ('root ::= "a"{2', ["expecting '}'"]),
    ('root ::= "a"{x}', ["expecting an integer"]),
    ('root ::= "a"{3,2}', ["minimum above its maximum"]),
    ('root ::= "a"{10001}', ["10,000", "10001"]),
    ('root ::= "a"{0,99999999}', ["10,000"]),
    ('root ::= "\\uD800"', ["UTF-8"]),
    # rules
    ('root ::= item\n\nitem ::= thing "x"', ["line 3", "'item'", "undefined rule 'thing'"]),
    ('start ::= "a"', ["no 'root' rule"]),
    ('root ::= "a"\nx ::= "b"\nx ::= "c"', ["line 3", "'x'", "defined twice", "line 2"]),
    # tokens
    ("root ::= !<[5]>", ["negated token", "not supported"]),
    ("root ::= <think>", ["<think>", "needs a tokenizer"]),
    ("root ::= <[12x]>", ["<[digits]>"]),
    ("root ::= <think", ["unterminated token"]),
])
def test_errors_name_the_line_and_rule(text: str, names: list[str]) -> None:
    with pytest.raises(GrammarError) as info:
        parse_gbnf(text)
    for name in names:
        assert name in str(info.value), (text, str(info.value))


def test_unknown_token_text_is_an_error() -> None:
    with pytest.raises(GrammarError, match=r"unknown token <nope>.*'root'"):
        parse_gbnf("root ::= <nope>", token_id={"<think>": 1}.get)


@pytest.mark.parametrize(("text", "names"), [
    ('root ::= expr\nexpr ::= expr "+" term | term\nterm ::= [0-9]+', ["line 2", "'expr'", "left-recursive",
                                                                        "expr -> expr"]),
    ('root ::= a\na ::= b "x" | "y"\nb ::= a "z"', ["line 2", "left-recursive", "a -> b -> a"]),
    # hidden: `opt` can be empty, so `a` reaches itself without consuming
    ('root ::= a\na ::= opt a "x" | "y"\nopt ::= "z"?', ["'a'", "left-recursive", "a -> a"]),
    ('root ::= ("x"? | "") root "y" | "z"', ["line 1", "root -> root"]),
    ('root ::= ws* root\nws ::= " "?', ["left-recursive"]),
    ('root ::= root', ["left-recursive", "root -> root"]),
    # never finishes
    ('root ::= "a" root', ["line 1", "'root'", "never finish"]),
    ('root ::= "x" | a\na ::= "(" b ")"\nb ::= "[" a "]"', ["line 2", "'a'", "never finish", "'b'"]),
])
def test_left_recursion_and_non_termination_are_refused(text: str, names: list[str]) -> None:
    with pytest.raises(GrammarError) as info:
        parse_gbnf(text)
    for name in names:
        assert name in str(info.value), (text, str(info.value))


def test_right_recursion_with_an_exit_is_fine() -> None:
    g = 'root ::= item\nitem ::= "a" item | "b"'
    assert matches(g, "aaab") and not matches(g, "aaa")


def test_check_grammar_works_on_ir_from_any_front_end() -> None:
    check_grammar(Grammar({"root": seq(lit("a"), Repeat(Ref("root"), 0, 1))}))
    with pytest.raises(GrammarError, match=r"^grammar: rule 'x' is left-recursive \(x -> y -> x"):
        check_grammar(Grammar({"root": Ref("x"), "x": seq(Ref("y"), lit("a")), "y": Ref("x")}))
    with pytest.raises(GrammarError, match="undefined rule 'z'"):
        check_grammar(Grammar({"root": Ref("z")}))
    with pytest.raises(GrammarError, match="no start rule"):
        check_grammar(Grammar({"other": lit("a")}))
    with pytest.raises(GrammarError, match="'root' can never finish"):
        check_grammar(Grammar({"root": seq(Token(3), Ref("root"))}))
    # Repeat with max 0 consumes nothing and enters nothing: no left recursion through it.
    check_grammar(Grammar({"root": seq(Repeat(Ref("root"), 0, 0), lit("a"))}))


def test_every_reference_under_a_node_is_found_and_checked() -> None:
    """iter_refs (read once per compile for the check, the cyclic rules and the inlining) walks sequences,
    alternations and repeats."""
    node = seq(Ref("a"), alt(Ref("b"), Repeat(seq(lit("x"), Ref("c")), 0, 3)), Repeat(Ref("d"), 1, None), Token(3))
    assert sorted(iter_refs(node)) == ["a", "b", "c", "d"] and iter_refs(lit("x")) == []
    with pytest.raises(GrammarError, match="rule 'root' refers to undefined rule 'z'"):
        compile_grammar(Grammar({"root": seq(lit("a"), Repeat(alt(lit("b"), Ref("z")), 0, 2))}), "undefined")


def test_nullable_rules() -> None:
    grammar = Grammar({"root": seq(Ref("a"), Ref("b")), "a": Repeat(lit("x"), 0, None),
                       "b": Repeat(Ref("a"), 1, 3), "c": lit("c")})
    assert nullable_rules(grammar) == {"root", "a", "b"}
