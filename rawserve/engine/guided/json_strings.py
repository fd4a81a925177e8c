"""JSON string text as grammar IR: characters and escapes, and pattern/format content fitted into a string
(minLength/maxLength, json.dumps's escapes, an object key that is none of the listed ones)."""
from __future__ import annotations

from .grammar import (Alt, Bytes, ByteSet, GrammarError, Node, Repeat, Seq, alt, byte_set, codepoint_ranges,
                      complement_codepoints, lit, seq)


def chars(text: str) -> ByteSet:
    return byte_set([(ord(c), ord(c)) for c in text])


HEX = chars("0123456789abcdefABCDEF")
_SPECIAL = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # what JSON strings must escape
_PLAIN = codepoint_ranges(complement_codepoints(_SPECIAL))
# \uXXXX outside the surrogates, or a high+low surrogate pair: one character either way.
_U_ESCAPE = alt(
    seq(lit("\\u"), chars("0123456789abcefABCEF"), HEX, HEX, HEX),
    seq(lit("\\u"), chars("dD"), byte_set([(0x30, 0x37)]), HEX, HEX),
    seq(lit("\\u"), chars("dD"), chars("89abAB"), HEX, HEX,
        lit("\\u"), chars("dD"), chars("cdefCDEF"), HEX, HEX))
CHAR = alt(_PLAIN, seq(lit("\\"), chars('"\\/bfnrt')), _U_ESCAPE)
# A plain string's body after its opening quote. A schema's plain strings, and any JSON value's, all refer to one
# rule of it (SchemaCompiler.plain_string), which the NFA calls rather than inlines once two use it (its 69 nodes
# are over nfa.INLINE_MAX_NODES): a configuration inside any of them is then the same NFA states on another stack,
# and cut to no frames one configuration, so the string lexeme's pairing (lexemes.LexemeWalk.match) is proven once
# per schema, not once per property (a 20-property schema's first pass: 19% fewer configurations).
STRING_BODY = seq(Repeat(CHAR, 0, None), lit('"'))
_JSON_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}

# ----- string content: length bounds, JSON escapes, the key that is none of the listed keys


def _char_span(node: Node) -> tuple[int, int | None]:
    """(min, max) characters a UTF-8 byte pattern spells; max None when unbounded."""
    if isinstance(node, Bytes):
        n = sum(1 for b in node.data if not 0x80 <= b <= 0xBF)
        return n, n
    if isinstance(node, ByteSet):
        n = 0 if all(0x80 <= lo and hi <= 0xBF for lo, hi in node.ranges) else 1
        return n, n
    if isinstance(node, Seq):
        spans = [_char_span(item) for item in node.items]
        highs = [h for _, h in spans]
        return sum(lo for lo, _ in spans), None if None in highs else sum(highs)
    if isinstance(node, Alt):
        spans = [_char_span(item) for item in node.items]
        highs = [h for _, h in spans]
        return min(lo for lo, _ in spans), None if None in highs else max(highs)
    if isinstance(node, Repeat):
        lo, hi = _char_span(node.item)
        if hi == 0:
            return 0, 0
        return lo * node.min, None if node.max is None or hi is None else hi * node.max
    raise GrammarError(f"a string pattern cannot contain {type(node).__name__}")


def fit_length(content: Node, lo: int, hi: int | None, path: str) -> Node:
    """Apply minLength/maxLength to pattern/format content: exact when the content is one repeated
    character (`[a-z]+`) or when its length already lies within the bounds; refused otherwise."""
    if lo == 0 and hi is None:
        return content
    if isinstance(content, Repeat) and _char_span(content.item) == (1, 1):
        new_lo = max(content.min, lo)
        new_hi = hi if content.max is None else content.max if hi is None else min(hi, content.max)
        if new_hi is not None and new_lo > new_hi:
            raise GrammarError(f"minLength/maxLength leave no string the {path.rsplit('/', 1)[1]} at {path} allows")
        return Repeat(content.item, new_lo, new_hi)
    span_lo, span_hi = _char_span(content)
    if span_lo >= lo and (hi is None or (span_hi is not None and span_hi <= hi)):
        return content
    raise GrammarError(f"minLength/maxLength together with the {path.rsplit('/', 1)[1]} at {path} are "
                       "supported only when the pattern is one repeated character or already within the bounds")


def escape_content(node: Node, path: str) -> Node:
    """Pattern content as it is spelled inside a JSON string: `"`, `\\` and controls take json.dumps's escape."""
    return _escape(node, path, {})


def _escaped_byte(b: int) -> Node:
    return lit(_JSON_ESCAPES.get(b, f"\\u{b:04x}"))


def _escape(n: Node, path: str, memo: dict[int, Node]) -> Node:
    """escape_content of one node, memo by node id. A module function, not a recursive closure: that is a cycle
    through its cell, left for the garbage collector to find with the nodes it held."""
    hit = memo.get(id(n))
    if hit is not None:
        return hit
    if isinstance(n, Bytes):
        out = seq(*(_escaped_byte(b) if b < 0x20 or b in (0x22, 0x5C) else Bytes(bytes((b,)))
                    for b in n.data)) if any(b < 0x20 or b in (0x22, 0x5C) for b in n.data) else n
    elif isinstance(n, ByteSet):
        special = [b for lo, hi in _SPECIAL for b in range(lo, hi + 1)
                   if any(r_lo <= b <= r_hi for r_lo, r_hi in n.ranges)]
        if not special:
            out = n
        else:
            rest = [(lo, hi) for lo, hi in n.ranges]
            for b in special:
                rest = [piece for lo, hi in rest
                        for piece in (((lo, b - 1), (b + 1, hi)) if lo <= b <= hi else ((lo, hi),))
                        if piece[0] <= piece[1]]
            out = alt(*([byte_set(rest)] if rest else []), *(_escaped_byte(b) for b in special))
    elif isinstance(n, Seq):
        out = seq(*(_escape(item, path, memo) for item in n.items))
    elif isinstance(n, Alt):
        out = alt(*(_escape(item, path, memo) for item in n.items))
    elif isinstance(n, Repeat):
        out = Repeat(_escape(n.item, path, memo), n.min, n.max)
    else:
        raise GrammarError(f"the pattern at {path} compiled to a {type(n).__name__}, which a string cannot hold")
    memo[id(n)] = out
    return out


def key_except(names: list[str]) -> Node:
    """A raw (escape-free) JSON string that is none of `names`: a trie with a way out at every node."""
    trie: dict = {}
    for name in names:
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[None] = True  # a listed key ends here
    order: list[dict] = []  # parents before children; built back to front, without recursion
    stack = [trie]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(child for ch, child in node.items() if ch is not None)
    built: dict[int, Node] = {}
    plain_tail = seq(Repeat(_PLAIN, 0, None), lit('"'))
    for node in reversed(order):
        children = sorted(ch for ch in node if ch is not None and ord(ch) > 0x1F and ch not in '"\\'
                          and not 0xD800 <= ord(ch) <= 0xDFFF)
        parts = [] if None in node else [lit('"')]
        parts += [seq(lit(ch), built[id(node[ch])]) for ch in children]
        others = complement_codepoints(_SPECIAL + [(ord(ch), ord(ch)) for ch in children])
        parts.append(seq(codepoint_ranges(others), plain_tail))
        built[id(node)] = alt(*parts)
    return seq(lit('"'), built[id(trie)])

