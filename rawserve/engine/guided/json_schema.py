"""JSON Schema -> grammar IR (response_format json_schema, tool arguments) and the any-JSON-object grammar.

Owns the supported schema subset and how each keyword maps to rules. It never validates instances, builds
automata or touches a tokenizer. A schema it cannot enforce exactly is refused with a GrammarError, never loosened.

Whitespace policy (`whitespace=`):
  "compact" (default): one optional space after `,` and after `:` and no whitespace anywhere else. Both
      `json.dumps(x)` (", " and ": ") and `separators=(",", ":")` match. A small model cannot loop on
      whitespace because there is never more than one byte of it.
  "pretty": "compact" plus a newline and 0-20 spaces/tabs after `,`, `:`, `{` and `[` and before `}` and
      `]` (what `json.dumps(x, indent=n)` emits up to indentation 20). No whitespace goes before `,` or
      `:` or around the top-level value.

Supported keywords:
  type (including a list of types), enum, const, anyOf, oneOf (compiled as anyOf: a value that matches
  two branches passes), allOf with one subschema, $ref to `#` or `#/...` JSON pointers (`$defs`,
  `definitions`; every referenced pointer becomes one named rule, so recursion is a real recursive rule),
  nullable (OpenAPI: also null), properties, required, additionalProperties, minProperties and
  maxProperties (only when trivially satisfied), items, prefixItems, additionalItems (beside an
  array-valued `items`), minItems, maxItems, uniqueItems (false, or maxItems <= 1), minLength, maxLength,
  pattern, format (date-time, date, time, duration, email, hostname, ipv4, ipv6, uuid, uri), minimum,
  maximum, exclusiveMinimum and exclusiveMaximum (number or draft-4 boolean), and multipleOf when it only
  says "integer" (1, 0.5, ...).
  Ignored annotations: title, description, default, examples, example, $schema, $id, $comment, strict,
  deprecated, readOnly, writeOnly, discriminator, $defs and definitions (as containers), and `x-*` extensions.
  Any other keyword is refused: `unsupported JSON Schema keyword 'not' at #/properties/a`.

Where the grammar is narrower than JSON Schema (every output is valid; some valid values are unreachable):
  - Properties come in schema order. When `properties` is given and `additionalProperties` is absent,
    no other keys are allowed (OpenAI strict mode and xgrammar do the same). With `additionalProperties:
    true` or a schema, extra keys follow the listed ones, are spelled without escapes, and cannot equal a
    listed key.
  - Without `type`, the type is inferred from type-specific keywords (`properties` -> object, `items` ->
    array, `minLength` -> string, `minimum` -> number). JSON Schema would let other types through.
  - Numbers: at most 19 integer digits, 16 fraction digits and 3 exponent digits. Integers cannot be
    written `1.0`. With minimum/maximum, exponents are allowed only on a side the bounds leave open
    (`minimum: 0` still allows `1e5`). Bounds are compared with the decimal text exactly. A text within
    one double ulp of an exclusive bound may still round onto that bound.
  - Strings under `pattern`/`format` must spell non-ASCII characters raw (UTF-8), not as `\\uXXXX`.
    Characters JSON must escape (`"`, `\\`, controls) take json.dumps's escape. The pattern must match the
    whole content: `^`/`$` are implied, as OpenAI and vLLM treat it.
  - Lone surrogate escapes (`\\ud800` without its pair) are refused. A pair counts as one character for
    minLength/maxLength, as in Python.
  - enum/const values are matched as json.dumps spells them (either ensure_ascii form; an integral float
    also without `.0`). Object members keep their given order.

Refused as well: a schema no value satisfies, a $ref cycle that consumes no text or never ends (a node
that requires a node), nesting deeper than 64, more than 10,000 enum values or grammar nodes.
"""
from __future__ import annotations

import json
import math
import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from urllib.parse import unquote

from .gbnf import check_grammar
from .grammar import (EMPTY, Alt, Bytes, ByteSet, Grammar, GrammarError, Node, Ref, Repeat,
                      Seq, accepts, alt, byte_set, codepoint_ranges, complement_codepoints, lit, optional, seq)

MAX_SCHEMA_DEPTH = 64
MAX_GRAMMAR_NODES = 10_000  # distinct IR nodes one schema may add; also caps subschema visits
MAX_INDENT = 20  # "pretty": spaces/tabs after a newline
INT_DIGITS = 19  # integer part of integers and numbers
FRAC_DIGITS = 16
EXP_DIGITS = 3

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "example", "$schema", "$id", "$comment", "strict",
    "deprecated", "readOnly", "writeOnly", "discriminator", "$defs", "definitions"})
_CONSTRAINTS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable",
    "properties", "required", "additionalProperties", "minProperties", "maxProperties",
    "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_TYPE_KEYWORDS = (
    ("object", frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties"})),
    ("array", frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"})),
    ("string", frozenset({"minLength", "maxLength", "pattern", "format"})),
    ("number", frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})))
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Keywords that read each other inside one schema object: merging a parent into an anyOf/allOf branch is
# exact only when a group comes whole from one side.
_COUPLED = (frozenset({"properties", "additionalProperties"}),
            frozenset({"prefixItems", "items", "additionalItems"}))

# ----- lexical pieces shared by every schema


def _chars(text: str) -> ByteSet:
    return byte_set([(ord(c), ord(c)) for c in text])


_DIGIT = byte_set([(0x30, 0x39)])
_HEX = _chars("0123456789abcdefABCDEF")
_SPECIAL = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # what JSON strings must escape
_PLAIN = codepoint_ranges(complement_codepoints(_SPECIAL))
# \uXXXX outside the surrogates, or a high+low surrogate pair: one character either way.
_U_ESCAPE = alt(
    seq(lit("\\u"), _chars("0123456789abcefABCEF"), _HEX, _HEX, _HEX),
    seq(lit("\\u"), _chars("dD"), byte_set([(0x30, 0x37)]), _HEX, _HEX),
    seq(lit("\\u"), _chars("dD"), _chars("89abAB"), _HEX, _HEX,
        lit("\\u"), _chars("dD"), _chars("cdefCDEF"), _HEX, _HEX))
_CHAR = alt(_PLAIN, seq(lit("\\"), _chars('"\\/bfnrt')), _U_ESCAPE)
_STRING = seq(lit('"'), Repeat(_CHAR, 0, None), lit('"'))
_UINT = alt(lit("0"), seq(byte_set([(0x31, 0x39)]), Repeat(_DIGIT, 0, INT_DIGITS - 1)))
_FRACTION = optional(seq(lit("."), Repeat(_DIGIT, 1, FRAC_DIGITS)))
_EXPONENT = optional(seq(_chars("eE"), optional(_chars("+-")), Repeat(_DIGIT, 1, EXP_DIGITS)))
_MAGNITUDE = seq(_UINT, _FRACTION, _EXPONENT)
_NUMBER = seq(optional(lit("-")), _MAGNITUDE)
_INTEGER = seq(optional(lit("-")), _UINT)
_NULL = lit("null")
_JSON_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


def _alt_many(nodes: list[Node]) -> Node | None:
    """alt() for long lists (enum values, anyOf branches, object openers): dedupe by hash, not by the
    pairwise scan alt() does, which took 40 s for a 20,000-value enum. None when empty."""
    flat: dict[Node, None] = {}
    for node in nodes:
        for part in (node.items if isinstance(node, Alt) else (node,)):
            flat[part] = None
    if not flat:
        return None
    return next(iter(flat)) if len(flat) == 1 else Alt(tuple(flat))


def _pointer_token(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


# ----- public entry points


def schema_to_grammar(schema: dict | bool, *, whitespace: str = "compact") -> Grammar:
    """The grammar of JSON texts valid for `schema` (see the module docstring for the subset and policy).

    Deterministic: the same schema and policy give the same rules and names, so callers may cache by the
    canonical schema text.
    """
    rules: dict[str, Node] = {}
    node = add_schema_rules(rules, schema, "", whitespace)
    rules["root"] = node  # no rule the compiler makes is named "root" (ref rules are "def_*")
    return Grammar(rules, "root", notes={"whitespace": whitespace})


def json_object_grammar(whitespace: str = "compact") -> Grammar:
    """Any JSON object (response_format json_object), nested arbitrarily, through the recursive rules
    `value`, `object` and `array`."""
    rules: dict[str, Node] = {}
    compiler = _Compiler(rules, True, "", whitespace)
    compiler.any_json()
    rules["root"] = Ref(compiler.any_object)
    return Grammar(rules, "root", notes={"whitespace": whitespace})


def add_schema_rules(rules: dict[str, Node], schema: dict | bool, prefix: str,
                     whitespace: str = "compact") -> Node:
    """Add the rules for `schema` to `rules` under names starting with `prefix`; return the node for one value.

    For embedding a schema in a larger grammar (a tool call's `"arguments": <schema>`). `$ref`s resolve
    against `schema` itself. Names already in `rules` are never overwritten; give each schema its own prefix.
    """
    before = set(rules)
    try:
        return _add_schema_rules(rules, before, schema, prefix, whitespace)
    except GrammarError:
        for name in set(rules) - before:  # leave the caller's rules as they were
            del rules[name]
        raise


def _add_schema_rules(rules: dict[str, Node], before: set[str], schema: dict | bool, prefix: str,
                      whitespace: str) -> Node:
    compiler = _Compiler(rules, schema, prefix, whitespace)
    if _refers_to_root(schema):  # compile the root once, as the rule its `#` references recurse into
        node = compiler.ref("#", "#", 0)
    else:
        node = compiler.compile(schema, "#", 0)
    if node is None:
        raise GrammarError("the schema at # matches no JSON value")
    added = {name: rules[name] for name in rules if name not in before}
    size = count_nodes([node, *added.values()])
    if size > MAX_GRAMMAR_NODES:
        raise GrammarError(f"the schema compiles to {size:,} grammar nodes; the limit is {MAX_GRAMMAR_NODES:,}")
    # A $ref cycle through required members (a node that must hold a node) has no finite value: the
    # model could never finish. check_grammar finds such rules (and re-checks left recursion).
    start = compiler.fresh("start")
    try:
        check_grammar(Grammar({**added, start: node}, start))
    except GrammarError as e:
        raise GrammarError(f"the schema has no finite JSON value: {e}") from e
    return node


def count_nodes(roots: list[Node]) -> int:
    """Distinct IR nodes reachable from `roots` without following rule references (grammar size)."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, (Seq, Alt)):
            stack.extend(node.items)
        elif isinstance(node, Repeat):
            stack.append(node.item)
    return len(seen)


def _refers_to_root(schema: object) -> bool:
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("$ref") == "#":
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


# ----- the compiler


class _Compiler:
    def __init__(self, rules: dict[str, Node], root: dict | bool, prefix: str, whitespace: str) -> None:
        if whitespace == "compact":
            sep, inner = optional(lit(" ")), EMPTY
        elif whitespace == "pretty":
            newline = seq(lit("\n"), Repeat(_chars(" \t"), 0, MAX_INDENT))
            sep, inner = optional(alt(lit(" "), newline)), optional(newline)
        else:
            raise GrammarError(f"whitespace must be 'compact' or 'pretty', not {whitespace!r}")
        self.rules, self.root, self.prefix = rules, root, prefix
        self.inner = inner  # after `{` `[`, before `}` `]`
        self.comma = seq(lit(","), sep)
        self.colon = seq(lit(":"), sep)
        self.taken: set[str] = set()
        self.ref_rules: dict[str, str] = {}  # JSON pointer -> rule name
        self.head: set[str] = set()  # pointers entered since the last `{` or `[`: a $ref back to one loops
        self.any_value = self.any_object = ""
        self.num_visits = 0

    def fresh(self, base: str) -> str:
        name, n = self.prefix + base, 2
        while name in self.rules or name in self.taken:
            name, n = f"{self.prefix}{base}_{n}", n + 1
        self.taken.add(name)
        return name

    def share(self, node: Node, base: str) -> Node:
        """A node used in two places becomes a rule, so the grammar stays linear in the schema."""
        if isinstance(node, (Bytes, Ref)):
            return node
        name = self.fresh(base)
        self.rules[name] = node
        return Ref(name)

    def wrap(self, open_: str, body: Node | None, allow_empty: bool, close: str) -> Node | None:
        parts = [seq(lit(open_), self.inner, lit(close))] if allow_empty else []
        if body is not None:
            parts.append(seq(lit(open_), self.inner, body, self.inner, lit(close)))
        return alt(*parts) if parts else None

    def any_json(self) -> Node:
        if not self.any_value:
            self.any_value, self.any_object = self.fresh("value"), self.fresh("object")
            array = self.fresh("array")
            value = Ref(self.any_value)
            self.rules[self.any_value] = alt(Ref(self.any_object), Ref(array), _STRING, _NUMBER,
                                             lit("true"), lit("false"), _NULL)
            member = seq(_STRING, self.colon, value)
            self.rules[self.any_object] = self.wrap(
                "{", seq(member, Repeat(seq(self.comma, member), 0, None)), True, "}")
            self.rules[array] = self.wrap("[", seq(value, Repeat(seq(self.comma, value), 0, None)), True, "]")
        return Ref(self.any_value)

    # ----- schema objects and composition

    def compile(self, schema: object, path: str, depth: int) -> Node | None:
        """The node for values valid under `schema`, or None when no value is."""
        self.num_visits += 1
        if self.num_visits > MAX_GRAMMAR_NODES:
            raise GrammarError(f"the schema has more than {MAX_GRAMMAR_NODES:,} subschemas to compile")
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels at {path}")
        if schema is True:
            return self.any_json()
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise GrammarError(f"a schema must be an object or a boolean at {path}")
        for key in schema:
            if key not in _CONSTRAINTS and key not in _ANNOTATIONS and not key.startswith("x-"):
                raise GrammarError(f"unsupported JSON Schema keyword {key!r} at {path}")
        c = {k: v for k, v in schema.items() if k in _CONSTRAINTS}
        nullable = c.pop("nullable", False)
        if not isinstance(nullable, bool):
            raise GrammarError(f"'nullable' must be a boolean at {path}")
        node = self.constraints(c, path, depth)
        if nullable:
            node = _NULL if node is None else alt(node, _NULL)
        return node

    def constraints(self, c: dict, path: str, depth: int) -> Node | None:
        if "$ref" in c:
            others = sorted(set(c) - {"$ref"})
            if others:
                raise GrammarError(f"keyword {others[0]!r} beside '$ref' at {path} is not supported "
                                   "(move it into the referenced schema)")
            return self.ref(c["$ref"], path, depth)
        if "allOf" in c:
            subs = c["allOf"]
            if not isinstance(subs, list) or len(subs) != 1:
                count = len(subs) if isinstance(subs, list) else "a non-list"
                raise GrammarError(f"'allOf' at {path} has {count} subschemas; only a single one is supported")
            rest = {k: v for k, v in c.items() if k != "allOf"}
            where = f"{path}/allOf/0"
            return self.compile(_merge(rest, subs[0], where), where, depth + 1)
        for key in ("anyOf", "oneOf"):
            if key in c:
                branches = c[key]
                if not isinstance(branches, list) or not branches:
                    raise GrammarError(f"'{key}' at {path} must be a non-empty list of schemas")
                rest = {k: v for k, v in c.items() if k != key}
                nodes = []
                for i, branch in enumerate(branches):
                    where = f"{path}/{key}/{i}"
                    node = self.compile(_merge(rest, branch, where), where, depth + 1)
                    if node is not None:
                        nodes.append(node)
                return _alt_many(nodes)
        if "enum" in c or "const" in c:
            return self.enum(c, path, depth)
        parts = []
        for kind in _types(c, path):
            if kind in ("object", "array"):  # a `{` or `[` is consumed first: a $ref inside is not a loop
                saved, self.head = self.head, set()
                try:
                    node = (self.object if kind == "object" else self.array)(c, path, depth)
                finally:
                    self.head = saved
            elif kind == "any":
                node = self.any_json()
            elif kind == "string":
                node = self.string(c, path)
            elif kind in ("number", "integer"):
                node = self.number(c, path, kind)
            else:
                node = {"boolean": alt(lit("true"), lit("false")), "null": _NULL}[kind]
            if node is not None:
                parts.append(node)
        return alt(*parts) if parts else None

    def ref(self, ref: object, path: str, depth: int) -> Node:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise GrammarError(f"$ref {ref!r} at {path}: only references into this schema ('#', '#/...') "
                               "are supported")
        pointer = unquote(ref)
        if pointer in self.head:
            raise GrammarError(f"$ref {ref!r} at {path} loops back to itself without consuming any text")
        name = self.ref_rules.get(pointer)
        if name is not None:
            return Ref(name)
        target = _resolve(self.root, pointer, ref, path)
        tokens = pointer[2:].split("/") if pointer != "#" else ["schema"]
        if len(tokens) == 2 and tokens[0] in ("$defs", "definitions"):
            tokens = tokens[1:]
        name = self.fresh("def_" + re.sub(r"[^A-Za-z0-9_]", "_", "_".join(tokens)))
        self.ref_rules[pointer] = name
        self.head.add(pointer)
        try:
            node = self.compile(target, pointer, depth + 1)
        finally:
            self.head.discard(pointer)
        if node is None:
            raise GrammarError(f"the schema at {pointer} (referenced at {path}) matches no JSON value")
        self.rules[name] = node
        return Ref(name)

    def enum(self, c: dict, path: str, depth: int) -> Node | None:
        values: list = []
        if "enum" in c:
            if not isinstance(c["enum"], list):
                raise GrammarError(f"'enum' at {path} must be a list")
            values = list(c["enum"])
        if "const" in c:
            const = c["const"]
            values = [const] if "enum" not in c else [v for v in values if _same(v, const)]
        if len(values) > MAX_GRAMMAR_NODES:
            raise GrammarError(f"'enum' at {path} has {len(values):,} values; the limit is {MAX_GRAMMAR_NODES:,}")
        rest = {k: v for k, v in c.items() if k not in ("enum", "const")}
        if set(rest) == {"type"}:
            kinds = set(_types(rest, path))
            values = [v for v in values if _json_type(v) in kinds
                      or (_json_type(v) == "integer" and "number" in kinds)]
        elif rest:
            # The values must also satisfy the sibling keywords: check each against their grammar.
            # accepts() is the slow reference matcher, but enum values are few and short.
            check = _Compiler({}, self.root, "", "compact")
            node = check.compile(rest, path, depth)
            if node is None:
                return None
            start = check.fresh("enum_check")
            check.rules[start] = node
            grammar = Grammar(check.rules, start)
            values = [v for v in values if _fits(grammar, v)]
        return _alt_many([self.literal(v, path, depth) for v in values])

    def literal(self, value: object, path: str, depth: int) -> Node:
        """The JSON text of `value` under this whitespace policy (enum/const)."""
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"an enum/const value nests deeper than {MAX_SCHEMA_DEPTH} levels at {path}")
        if value is None or isinstance(value, bool):
            return lit(json.dumps(value))
        if isinstance(value, int):
            return lit(str(value))
        if isinstance(value, float):
            if not math.isfinite(value):
                raise GrammarError(f"enum/const value {value!r} at {path} is not valid JSON")
            return alt(lit(repr(value)), lit(str(int(value)))) if value.is_integer() else lit(repr(value))
        if isinstance(value, str):
            return self.key(value)
        if isinstance(value, list):
            items = [self.literal(v, path, depth + 1) for v in value]
            body = seq(items[0], *(seq(self.comma, item) for item in items[1:])) if items else None
            return self.wrap("[", body, not items, "]")
        if isinstance(value, dict):
            members = [seq(self.key(str(k)), self.colon, self.literal(v, path, depth + 1))
                       for k, v in value.items()]
            body = seq(members[0], *(seq(self.comma, m) for m in members[1:])) if members else None
            return self.wrap("{", body, not members, "}")
        raise GrammarError(f"enum/const value {value!r} at {path} is not JSON")

    @staticmethod
    def key(text: str) -> Node:
        """A string literal, raw or with json.dumps's \\u escapes for non-ASCII."""
        try:
            raw = lit(json.dumps(text, ensure_ascii=False))
        except UnicodeEncodeError:  # a lone surrogate has no UTF-8 spelling, only its \\u escape
            return lit(json.dumps(text))
        return alt(raw, lit(json.dumps(text)))

    # ----- objects

    def object(self, c: dict, path: str, depth: int) -> Node | None:
        props = c.get("properties", {})
        if not isinstance(props, dict):
            raise GrammarError(f"'properties' at {path} must be an object")
        required = c.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GrammarError(f"'required' at {path} must be a list of strings")
        required_set = set(required)
        extra = c.get("additionalProperties", "properties" not in c)
        extra_path = f"{path}/additionalProperties"
        extra_value: Node | None = None
        if extra is not False:
            extra_value = self.compile(extra, extra_path, depth + 1)

        names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
        members: list[tuple[Node, bool]] = []  # (`"key": value`, required)
        for name in names:
            if name in props:
                value = self.compile(props[name], f"{path}/properties/{_pointer_token(name)}", depth + 1)
            else:
                value = extra_value
            if value is None:
                if name in required_set:
                    return None  # a required property no value satisfies
                continue
            members.append((seq(self.key(name), self.colon, value), name in required_set))

        n = len(members)
        num_required = sum(req for _, req in members)
        extra_member = None
        if extra_value is not None:
            key = _key_except(names) if names else _STRING
            extra_member = self.share(seq(key, self.colon, extra_value), "extra")
        if "minProperties" in c and _count(c, "minProperties", path) > num_required:
            raise GrammarError(f"'minProperties' at {path} is supported only when the required properties "
                               "already satisfy it")
        if "maxProperties" in c and (extra_member is not None or _count(c, "maxProperties", path) < n):
            raise GrammarError(f"'maxProperties' at {path} is supported only when the listed properties "
                               "cannot exceed it (additionalProperties false)")

        # Linear encoding of optional members (xgrammar's suffix rules): `tail` is what may follow once
        # members before j are settled and one was written. A member that may come first (all before it
        # optional) opens the object and jumps into the shared tail after it.
        first_required = next((i for i, (_, req) in enumerate(members) if req), None)
        last_first = first_required if first_required is not None else n - 1
        tail: Node = Repeat(seq(self.comma, extra_member), 0, None) if extra_member is not None else EMPTY
        openers: list[Node] = []
        for j in range(n - 1, -1, -1):
            member, req = members[j]
            if 1 <= j <= last_first:  # member j opens the object or follows a comma
                member = self.share(member, "member")
                tail = self.share(tail, "tail")
            if j <= last_first:
                openers.append(seq(member, tail))
            if j >= 1:
                step = seq(self.comma, member)
                tail = seq(step if req else optional(step), tail)
        if first_required is None and extra_member is not None:
            openers.append(seq(extra_member, Repeat(seq(self.comma, extra_member), 0, None)))
        body = _alt_many(openers[::-1])
        return self.wrap("{", body, first_required is None, "}")

    # ----- arrays

    def array(self, c: dict, path: str, depth: int) -> Node | None:
        prefix = c.get("prefixItems", [])
        items = c.get("items", True)
        items_path = f"{path}/items"
        if isinstance(items, list):  # draft 4-2019 tuple form
            if "prefixItems" in c:
                raise GrammarError(f"'items' is a list beside 'prefixItems' at {path}")
            prefix, items, items_path = items, c.get("additionalItems", True), f"{path}/additionalItems"
        if not isinstance(prefix, list):
            raise GrammarError(f"'prefixItems' at {path} must be a list of schemas")
        lo = _count(c, "minItems", path) if "minItems" in c else 0
        hi = _count(c, "maxItems", path) if "maxItems" in c else None
        if c.get("uniqueItems", False) is not False and (hi is None or hi > 1):
            raise GrammarError(f"'uniqueItems' at {path} is not supported (a grammar cannot compare items)")

        heads: list[Node] = []
        item: Node | None = None
        for i, sub in enumerate(prefix):
            node = self.compile(sub, f"{path}/prefixItems/{i}", depth + 1)
            if node is None:  # no value fits position i: the array ends before it
                break
            heads.append(node)
        else:
            if items is not False:
                item = self.compile(items, items_path, depth + 1)
        if item is None or (hi is not None and hi <= len(heads)):
            limit = len(heads) if hi is None else min(hi, len(heads))
            heads, item, hi = heads[:limit], None, limit
        if hi is not None and lo > hi:
            return None
        if hi == 0:
            return self.wrap("[", None, True, "]")
        m = len(heads)
        tail: Node = EMPTY
        if item is not None:
            if m == 0:  # the item opens the array and repeats after it
                item = self.share(item, "item")
            start = max(m, 1)
            tail = Repeat(seq(self.comma, item), max(0, lo - start), None if hi is None else hi - start)
        for j in range(m - 1, 0, -1):  # after j elements: element j, unless the array may stop here
            step = seq(self.comma, heads[j], tail)
            tail = step if j < lo else optional(step)
        return self.wrap("[", seq(heads[0] if m else item, tail), lo == 0, "]")

    # ----- strings

    def string(self, c: dict, path: str) -> Node | None:
        lo = _count(c, "minLength", path) if "minLength" in c else 0
        hi = _count(c, "maxLength", path) if "maxLength" in c else None
        if hi is not None and lo > hi:
            return None
        if "pattern" in c and "format" in c:
            raise GrammarError(f"'pattern' and 'format' together at {path} are not supported")
        if "pattern" in c:
            from .regex import parse_regex  # imported here: the regex front end loads only when needed

            if not isinstance(c["pattern"], str):
                raise GrammarError(f"'pattern' at {path} must be a string")
            try:
                content = parse_regex(c["pattern"])
            except GrammarError as e:
                raise GrammarError(f"{e} (at {path}/pattern)") from e
            content = _escape_content(_fit_length(content, lo, hi, f"{path}/pattern"), path)
        elif "format" in c:
            make = _FORMATS.get(c["format"])
            if make is None:
                raise GrammarError(f"unsupported string format {c['format']!r} at {path}; supported: "
                                   + ", ".join(sorted(_FORMATS)))
            content = _fit_length(make(), lo, hi, f"{path}/format")
        else:
            content = Repeat(_CHAR, lo, hi)
        return seq(lit('"'), content, lit('"'))

    # ----- numbers

    def number(self, c: dict, path: str, kind: str) -> Node | None:
        if "multipleOf" in c:
            step = c["multipleOf"]
            if isinstance(step, bool) or not isinstance(step, (int, float)) or not step > 0:
                raise GrammarError(f"'multipleOf' at {path} must be a positive number")
            if (1 / _decimal(step)) % 1 != 0:
                raise GrammarError(f"'multipleOf' at {path} is supported only when it means 'integer' "
                                   "(1, 0.5, 0.25, ...)")
            kind = "integer"
        lower, upper = _bounds(c, path)
        if kind == "integer":
            lo = None if lower is None else int(lower[0].to_integral_value(ROUND_FLOOR)) + 1 if lower[1] \
                else int(lower[0].to_integral_value(ROUND_CEILING))
            hi = None if upper is None else int(upper[0].to_integral_value(ROUND_CEILING)) - 1 if upper[1] \
                else int(upper[0].to_integral_value(ROUND_FLOOR))
            return _integer(lo, hi)
        return _number(lower, upper)


def _types(c: dict, path: str) -> list[str]:
    """The JSON types a schema's value may take ('any' when nothing narrows it); integer under number."""
    if "type" in c:
        kinds = [c["type"]] if isinstance(c["type"], str) else c["type"]
        if not isinstance(kinds, list) or not kinds or any(k not in _TYPES for k in kinds):
            raise GrammarError(f"'type' at {path} must be one of {', '.join(_TYPES)} or a non-empty list of them")
    else:
        kinds = [kind for kind, keywords in _TYPE_KEYWORDS if keywords & c.keys()] or ["any"]
    if "number" in kinds:
        kinds = [k for k in kinds if k != "integer"]
    return list(dict.fromkeys(kinds))


def _merge(base: dict, branch: object, path: str) -> object:
    """`base` AND `branch` as one schema object (a parent's keywords distributed into anyOf/allOf)."""
    if not base or branch is False:
        return branch
    if branch is True:
        return base
    if not isinstance(branch, dict):
        raise GrammarError(f"a schema must be an object or a boolean at {path}")
    out = dict(branch)
    for key, value in base.items():
        if key not in out or out[key] == value:
            out[key] = value
        elif key == "type":
            mine = [value] if isinstance(value, str) else value
            theirs = [out[key]] if isinstance(out[key], str) else out[key]
            both = [t for t in theirs if t in mine or (t == "integer" and "number" in mine)]
            both += ["integer" for t in theirs if t == "number" and "integer" in mine]
            if not both:
                return False
            out[key] = list(dict.fromkeys(both))
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = list(dict.fromkeys(out[key] + value))
        else:
            raise GrammarError(f"keyword {key!r} is set both at {path} and in its parent; "
                               "combining them is not supported")
    for group in _COUPLED:
        if group & base.keys() and group & branch.keys() and group & base.keys() != group & branch.keys():
            raise GrammarError(f"{sorted(group & branch.keys())} at {path} and {sorted(group & base.keys())} "
                               "in its parent depend on each other; write them in one schema")
    return out


def _resolve(root: object, pointer: str, ref: str, path: str) -> object:
    node = root
    if pointer == "#":
        return node
    for token in pointer[2:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise GrammarError(f"$ref {ref!r} at {path} points to nothing in the schema")
    return node


def _count(c: dict, key: str, path: str) -> int:
    value = c[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value % 1:
        raise GrammarError(f"'{key}' at {path} must be a non-negative integer")
    return int(value)


def _fits(grammar: Grammar, value: object) -> bool:
    try:
        return accepts(grammar, json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 text spells it
        return False


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "?")


def _same(a: object, b: object) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


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


def _fit_length(content: Node, lo: int, hi: int | None, path: str) -> Node:
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


def _escape_content(node: Node, path: str) -> Node:
    """Pattern content as it is spelled inside a JSON string: `"`, `\\` and controls take json.dumps's escape."""
    memo: dict[int, Node] = {}

    def escaped_byte(b: int) -> Node:
        return lit(_JSON_ESCAPES.get(b, f"\\u{b:04x}"))

    def walk(n: Node) -> Node:
        hit = memo.get(id(n))
        if hit is not None:
            return hit
        if isinstance(n, Bytes):
            out = seq(*(escaped_byte(b) if b < 0x20 or b in (0x22, 0x5C) else Bytes(bytes((b,)))
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
                out = alt(*([byte_set(rest)] if rest else []), *(escaped_byte(b) for b in special))
        elif isinstance(n, Seq):
            out = seq(*(walk(item) for item in n.items))
        elif isinstance(n, Alt):
            out = alt(*(walk(item) for item in n.items))
        elif isinstance(n, Repeat):
            out = Repeat(walk(n.item), n.min, n.max)
        else:
            raise GrammarError(f"the pattern at {path} compiled to a {type(n).__name__}, which a string cannot hold")
        memo[id(n)] = out
        return out

    return walk(node)


def _key_except(names: list[str]) -> Node:
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


# ----- numbers: exact decimal ranges


def _decimal(value: int | float) -> Decimal:
    return Decimal(value) if isinstance(value, int) else Decimal(repr(value))


Bound = tuple[Decimal, bool]  # (value, exclusive)


def _bounds(c: dict, path: str) -> tuple[Bound | None, Bound | None]:
    """The tightest lower and upper bound from minimum/maximum/exclusive* (draft 4 booleans too)."""
    def number(key: str) -> Decimal:
        v = c[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise GrammarError(f"'{key}' at {path} must be a finite number")
        return _decimal(v)

    lows: list[Bound] = []
    highs: list[Bound] = []
    for key, out, sign in (("minimum", lows, "exclusiveMinimum"), ("maximum", highs, "exclusiveMaximum")):
        if key in c:
            out.append((number(key), c.get(sign) is True))
        if sign in c and not isinstance(c[sign], bool):
            out.append((number(sign), True))
    lower = max(lows, key=lambda b: (b[0], b[1]), default=None)
    upper = min(highs, key=lambda b: (b[0], not b[1]), default=None)
    return lower, upper


def _digits(n: int) -> Node:
    return Repeat(_DIGIT, n, n) if n else EMPTY


def _same_length(lo: str, hi: str) -> Node:
    """Decimal strings of one length from lo to hi (digit-by-digit, as xgrammar's range regex)."""
    if not lo:
        return EMPTY
    if lo[0] == hi[0]:
        return seq(lit(lo[0]), _same_length(lo[1:], hi[1:]))
    n = len(lo) - 1
    first, last = int(lo[0]), int(hi[0])
    parts = []
    if lo[1:] != "0" * n:
        parts.append(seq(lit(lo[0]), _same_length(lo[1:], "9" * n)))
        first += 1
    if hi[1:] != "9" * n:
        parts.append(seq(lit(hi[0]), _same_length("0" * n, hi[1:])))
        last -= 1
    if first <= last:
        parts.append(seq(byte_set([(0x30 + first, 0x30 + last)]), _digits(n)))
    return alt(*parts)


def _uint_range(lo: int, hi: int) -> Node | None:
    """Non-negative integers lo..hi spelled without leading zeros; None when empty."""
    hi = min(hi, 10 ** INT_DIGITS - 1)
    if lo > hi:
        return None
    parts: list[Node] = []
    full: list[int] = []  # lengths >= 2 covered whole: merged into one [1-9][0-9]{a,b}
    for length in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (length - 1) if length > 1 else 0), min(hi, 10 ** length - 1)
        if length > 1 and a == 10 ** (length - 1) and b == 10 ** length - 1:
            full.append(length)
        elif a <= b:
            parts.append(_same_length(str(a), str(b)))
    if full:
        parts.append(seq(byte_set([(0x31, 0x39)]), Repeat(_DIGIT, full[0] - 1, full[-1] - 1)))
    return alt(*parts)


def _integer(lo: int | None, hi: int | None) -> Node | None:
    if lo is None and hi is None:
        return _INTEGER
    limit = 10 ** INT_DIGITS - 1
    lo = -limit if lo is None else lo
    hi = limit if hi is None else hi
    if lo > hi:
        return None
    parts = []
    if hi >= 0 and (node := _uint_range(max(lo, 0), hi)) is not None:
        parts.append(node)
    if lo < 0 and (node := _uint_range(max(-hi, 0), -lo)) is not None:  # `-0` when 0 is in range
        parts.append(seq(lit("-"), node))
    return alt(*parts) if parts else None


def _number(lower: Bound | None, upper: Bound | None) -> Node | None:
    zero = (Decimal(0), False)
    parts = []
    # n >= 0: its magnitude lies in [max(lower, 0), upper]
    if upper is None or upper[0] > 0 or (upper[0] == 0 and not upper[1]):
        node = _magnitude(zero if lower is None or lower[0] < 0 else lower, upper)
        if node is not None:
            parts.append(node)
    # n < 0 (and -0): its magnitude -n lies in [-min(upper, 0), -lower]
    if lower is None or lower[0] < 0:
        low = zero if upper is None or upper[0] > 0 else (-upper[0], upper[1])
        node = _magnitude(low, None if lower is None else (-lower[0], lower[1]))
        if node is not None:
            parts.append(seq(lit("-"), node))
    return alt(*parts) if parts else None


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal as (integer part, fraction digits without trailing zeros); exact."""
    whole, _, frac = format(value, "f").partition(".")
    return int(whole), frac.rstrip("0")


def _magnitude(low: Bound, high: Bound | None) -> Node | None:
    """Unsigned number texts whose value lies between low and high; exponents only when unbounded."""
    if low == (Decimal(0), False) and high is None:
        return _MAGNITUDE
    a, a_frac = _split(low[0])
    if high is not None and high[0] >= 10 ** INT_DIGITS:
        high = None  # above every integer part we spell
    parts = []
    if high is None:
        mid = _uint_range(a + 1, 10 ** INT_DIGITS - 1)
        if mid is not None:
            parts.append(seq(mid, _FRACTION))
        edge = _fraction(a_frac, low[1], None, False)
        if edge is not None and a < 10 ** INT_DIGITS:
            parts.append(seq(lit(str(a)), edge))
        return alt(*parts) if parts else None
    b, b_frac = _split(high[0])
    if a > b:
        return None
    if a == b:
        edge = _fraction(a_frac, low[1], b_frac, high[1])
        return None if edge is None else seq(lit(str(a)), edge)
    mid = _uint_range(a + 1, b - 1)
    if mid is not None:
        parts.append(seq(mid, _FRACTION))
    for digits, edge in ((a, _fraction(a_frac, low[1], None, False)), (b, _fraction("", False, b_frac, high[1]))):
        if edge is not None:
            parts.append(seq(lit(str(digits)), edge))
    return alt(*parts) if parts else None


def _fraction(lo: str, lo_excl: bool, hi: str | None, hi_excl: bool) -> Node | None:
    """An optional `.digits` fraction F with lo <= F <= hi (or < when exclusive), compared as 0.<digits>.

    A digit-by-digit walk: `tight_lo` means F's digits so far equal lo's (zero padded), so the next digit
    may not go below lo's; likewise `tight_hi`. hi None means no upper bound (F < 1 anyway).
    """
    memo: dict[tuple[int, bool, bool, bool], Node | None] = {}

    def can_end(pos: int, tight_lo: bool, tight_hi: bool) -> bool:  # the remaining digits are all 0
        if tight_lo and (lo[pos:].strip("0") or lo_excl):
            return False
        return not (tight_hi and hi is not None and not hi[pos:].strip("0") and hi_excl)

    def rest(pos: int, tight_lo: bool, tight_hi: bool, may_end: bool) -> Node | None:
        key = (pos, tight_lo, tight_hi, may_end)
        if key in memo:
            return memo[key]
        if not tight_lo and not tight_hi:
            node: Node | None = Repeat(_DIGIT, 0 if may_end else 1, FRAC_DIGITS - pos)
        else:
            parts = [EMPTY] if may_end and can_end(pos, tight_lo, tight_hi) else []
            if pos < FRAC_DIGITS:
                floor = int(lo[pos]) if tight_lo and pos < len(lo) else 0
                ceil = (int(hi[pos]) if pos < len(hi) else 0) if tight_hi and hi is not None else 9
                groups: dict[tuple[bool, bool], list[int]] = {}
                for d in range(floor, ceil + 1):
                    groups.setdefault((tight_lo and d == floor, tight_hi and d == ceil), []).append(d)
                for (next_lo, next_hi), ds in groups.items():
                    after = rest(pos + 1, next_lo, next_hi, True)
                    if after is not None:
                        parts.append(seq(byte_set([(0x30 + ds[0], 0x30 + ds[-1])]), after))
            node = alt(*parts) if parts else None
        memo[key] = node
        return node

    tight_lo = bool(lo) or lo_excl
    tight_hi = hi is not None
    dotted = rest(0, tight_lo, tight_hi, False)
    parts = [EMPTY] if can_end(0, tight_lo, tight_hi) else []
    if dotted is not None:
        parts.append(seq(lit("."), dotted))
    return alt(*parts) if parts else None


# ----- formats: fixed, fairly strict spellings


def _r(ranges: str) -> ByteSet:
    """A byte class from 'a-z0-9' style ASCII ranges (a trailing '-' is literal)."""
    spans, i = [], 0
    while i < len(ranges):
        if i + 2 < len(ranges) and ranges[i + 1] == "-":
            spans.append((ord(ranges[i]), ord(ranges[i + 2])))
            i += 3
        else:
            spans.append((ord(ranges[i]), ord(ranges[i])))
            i += 1
    return byte_set(spans)


def _date() -> Node:
    year = alt(seq(_r("1-9"), _digits(3)), seq(lit("0"), _r("1-9"), _digits(2)),
               seq(lit("00"), _r("1-9"), _DIGIT), seq(lit("000"), _r("1-9")))
    # divisible by 4 and not by 100, or by 400 (year 0000 does not exist)
    leap = alt(seq(_digits(2), alt(seq(lit("0"), _r("48")), seq(_r("2468"), _r("048")), seq(_r("13579"), _r("26")))),
               seq(alt(seq(lit("0"), _r("48")), seq(_r("2468"), _r("048")), seq(_r("13579"), _r("26"))), lit("00")))
    day28 = alt(seq(lit("0"), _r("1-9")), seq(lit("1"), _DIGIT), seq(lit("2"), _r("0-8")))
    day30 = alt(day28, lit("29"), lit("30"))
    day31 = alt(day30, lit("31"))
    return alt(seq(year, lit("-"), alt(*map(lit, ("01", "03", "05", "07", "08", "10", "12"))), lit("-"), day31),
               seq(year, lit("-"), alt(*map(lit, ("04", "06", "09", "11"))), lit("-"), day30),
               seq(year, lit("-02-"), day28),
               seq(leap, lit("-02-29")))


def _time() -> Node:
    hour = alt(seq(_r("01"), _DIGIT), seq(lit("2"), _r("0-3")))
    minute = seq(_r("0-5"), _DIGIT)
    second = minute  # no leap second :60: RFC 3339 allows it, but jsonschema's checker and datetime refuse it
    offset = alt(lit("Z"), seq(_r("+-"), hour, lit(":"), minute))
    return seq(hour, lit(":"), minute, lit(":"), second, optional(seq(lit("."), Repeat(_DIGIT, 1, 9))), offset)


def _duration() -> Node:
    n = Repeat(_DIGIT, 1, 9)

    def units(letters: str) -> Node:  # one or more of the units, in order
        out: Node | None = None
        for letter in reversed(letters):
            here = seq(n, lit(letter))
            out = here if out is None else alt(seq(here, optional(out)), out)
        return out

    time = seq(lit("T"), units("HMS"))
    return seq(lit("P"), alt(seq(units("YMD"), optional(time)), time, seq(n, lit("W"))))


def _hostname() -> Node:
    label = seq(_r("A-Za-z0-9"), optional(seq(Repeat(_r("A-Za-z0-9-"), 0, 61), _r("A-Za-z0-9"))))
    return seq(label, Repeat(seq(lit("."), label), 0, 126))


def _email() -> Node:
    atom = Repeat(_r("A-Za-z0-9!#$%&'*+/=?^_`{|}~-"), 1, 64)
    return seq(atom, Repeat(seq(lit("."), atom), 0, 31), lit("@"), _hostname())


def _ipv4() -> Node:
    octet = alt(seq(lit("25"), _r("0-5")), seq(lit("2"), _r("0-4"), _DIGIT), seq(lit("1"), _digits(2)),
                seq(_r("1-9"), _DIGIT), _DIGIT)
    return seq(octet, *(seq(lit("."), octet) for _ in range(3)))


def _ipv6() -> Node:
    """RFC 3986's IPv6address: eight groups, `::` standing for one or more zero groups, IPv4 tail."""
    h16 = Repeat(_HEX, 1, 4)
    ls32 = alt(seq(h16, lit(":"), h16), _ipv4())

    def groups(k: int) -> Node:  # k x "h16:"
        return Repeat(seq(h16, lit(":")), k, k) if k else EMPTY

    def upto(k: int) -> Node:  # [ *k(h16 ":") h16 ]
        return optional(seq(Repeat(seq(h16, lit(":")), 0, k), h16) if k else h16)

    forms = [seq(groups(6), ls32), seq(lit("::"), groups(5), ls32)]
    for before in range(0, 7):  # before = how many h16 may precede "::", minus one
        after = 4 - before
        if after >= 1:
            forms.append(seq(upto(before), lit("::"), groups(after), ls32))
        elif after == 0:
            forms.append(seq(upto(before), lit("::"), ls32))
        elif after == -1:
            forms.append(seq(upto(before), lit("::"), h16))
        else:
            forms.append(seq(upto(before), lit("::")))
    return alt(*forms)


def _uuid() -> Node:
    return seq(*(seq(lit("-") if i else EMPTY, Repeat(_HEX, n, n)) for i, n in enumerate((8, 4, 4, 4, 12))))


def _uri() -> Node:
    """An absolute URI: scheme ':' then URI characters (unreserved, reserved, %XX)."""
    scheme = seq(_r("A-Za-z"), Repeat(_r("A-Za-z0-9+.-"), 0, 31))
    char = alt(_r("A-Za-z0-9-._~:/?#[]@!$&'()*+,;="), seq(lit("%"), _HEX, _HEX))
    return seq(scheme, lit(":"), Repeat(char, 1, None))


_FORMATS = {
    "date-time": lambda: seq(_date(), lit("T"), _time()),
    "date": _date,
    "time": _time,
    "duration": _duration,
    "email": _email,
    "hostname": _hostname,
    "ipv4": _ipv4,
    "ipv6": _ipv6,
    "uuid": _uuid,
    "uri": _uri,
}
