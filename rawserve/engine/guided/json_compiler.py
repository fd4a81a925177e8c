"""Compiles one schema object, keyword by keyword, into grammar IR rules: $ref, anyOf/oneOf/allOf, enum/const,
objects, arrays and strings, under one whitespace policy. json_schema.py states the policy and wraps this;
it never validates instances, builds automata or touches a tokenizer."""
from __future__ import annotations

import json
import math
import re
from urllib.parse import unquote

from .grammar import (EMPTY, Alt, Bytes, Grammar, GrammarError, Node, Ref, Repeat, Seq, accepts, alt, lit,
                      optional, seq)
from .json_formats import FORMATS
from .json_keywords import (ANNOTATIONS, CONSTRAINTS, count_keyword, json_equal, json_type, merge_schemas,
                            pointer_token, resolve_pointer, schema_types)
from .json_numbers import NUMBER, number_node
from .json_strings import CHAR, STRING_BODY, chars, escape_content, fit_length, key_except

MAX_SCHEMA_DEPTH = 64
MAX_GRAMMAR_NODES = 10_000  # distinct IR nodes one schema may add; also caps subschema visits
# Nodes made while compiling, counted as they are made: past this the compile stops at once. Above the final
# limit because some made nodes are folded away before the end (a sequence flattened into its parent).
MAX_BUILT_NODES = 2 * MAX_GRAMMAR_NODES
MAX_INDENT = 20  # "pretty": spaces/tabs after a newline
_NULL = lit("null")


def _alt_many(nodes: list[Node]) -> Node | None:
    """alt() for a list that may be empty (enum values, anyOf branches, object openers): None when it is."""
    return alt(*nodes) if nodes else None


class SchemaCompiler:
    """Adds one schema's rules to `rules` under names starting with `prefix`; `$ref`s resolve against `root`."""

    def __init__(self, rules: dict[str, Node], root: dict | bool, prefix: str, whitespace: str) -> None:
        if whitespace == "compact":
            sep, inner = optional(lit(" ")), EMPTY
        elif whitespace == "pretty":
            newline = seq(lit("\n"), Repeat(chars(" \t"), 0, MAX_INDENT))
            sep, inner = optional(alt(lit(" "), newline)), optional(newline)
        else:
            raise GrammarError(f"whitespace must be 'compact' or 'pretty', not {whitespace!r}")
        self.rules, self.root, self.prefix = rules, root, prefix
        self.inner = inner  # after `{` `[`, before `}` `]`
        self.comma = seq(lit(","), sep)
        self.colon = seq(lit(":"), sep)
        self.taken: set[str] = set()
        self.next_suffix: dict[str, int] = {}
        self.ref_rules: dict[str, str] = {}  # JSON pointer -> rule name
        self.head: set[str] = set()  # pointers entered since the last `{` or `[`: a $ref back to one loops
        self.any_value = self.any_object = ""
        self.string_rule = ""
        self.is_recursive = False  # a $ref reached a schema still being compiled (json_schema checks the rules)
        self.num_visits = 0
        self.num_built = 0
        self._counted: set[int] = set()  # ids of the nodes in num_built

    def charge(self, node: Node) -> Node:
        """Count the nodes under `node` not counted yet; a GrammarError once past MAX_BUILT_NODES. Each node is
        walked once, so counting is linear in what is built."""
        counted = self._counted
        stack = [node]
        while stack:
            n = stack.pop()
            if id(n) in counted:
                continue
            counted.add(id(n))
            self.num_built += 1
            if isinstance(n, (Seq, Alt)):
                stack.extend(n.items)
            elif isinstance(n, Repeat):
                stack.append(n.item)
        if self.num_built > MAX_BUILT_NODES:
            raise GrammarError(f"the schema compiles to more than {MAX_GRAMMAR_NODES:,} grammar nodes "
                               f"(the limit); stopped at {self.num_built:,}")
        return node

    def fresh(self, base: str) -> str:
        # Numbering resumes where this base last stopped: scanning from 2 each time was quadratic (1.4 s for
        # the 6,000 member/tail rules of a 3,000-property object).
        name, n = self.prefix + base, self.next_suffix.get(base, 2)
        while name in self.rules or name in self.taken:
            name, n = f"{self.prefix}{base}_{n}", n + 1
        self.next_suffix[base] = n
        self.taken.add(name)
        return name

    def share(self, node: Node, base: str) -> Node:
        """A node used in two places becomes a rule, so the grammar stays linear in the schema."""
        if isinstance(node, (Bytes, Ref)):
            return node
        name = self.fresh(base)
        self.rules[name] = self.charge(node)
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
            # its strings (a value, the first key and the later ones) call the schema's one body rule, as its plain
            # strings do: json_object's three inlined copies were three string pairings in each new grammar's first
            # pass (~0.3 ms each, inside its first key's, first string value's and second key's masks), now one
            string = self.plain_string()
            self.rules[self.any_value] = alt(Ref(self.any_object), Ref(array), string, NUMBER,
                                             lit("true"), lit("false"), _NULL)
            member = seq(string, self.colon, value)
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
            if key not in CONSTRAINTS and key not in ANNOTATIONS and not key.startswith("x-"):
                raise GrammarError(f"unsupported JSON Schema keyword {key!r} at {path}")
        c = {k: v for k, v in schema.items() if k in CONSTRAINTS}
        nullable = c.pop("nullable", False)
        if not isinstance(nullable, bool):
            raise GrammarError(f"'nullable' must be a boolean at {path}")
        node = self.constraints(c, path, depth)
        if nullable:
            node = _NULL if node is None else alt(node, _NULL)
        return node if node is None else self.charge(node)

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
            return self.compile(merge_schemas(rest, subs[0], where), where, depth + 1)
        for key in ("anyOf", "oneOf"):
            if key in c:
                branches = c[key]
                if not isinstance(branches, list) or not branches:
                    raise GrammarError(f"'{key}' at {path} must be a non-empty list of schemas")
                rest = {k: v for k, v in c.items() if k != key}
                nodes = []
                for i, branch in enumerate(branches):
                    where = f"{path}/{key}/{i}"
                    node = self.compile(merge_schemas(rest, branch, where), where, depth + 1)
                    if node is not None:
                        nodes.append(node)
                return _alt_many(nodes)
        if "enum" in c or "const" in c:
            return self.enum(c, path, depth)
        parts = []
        for kind in schema_types(c, path):
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
                node = number_node(c, path, kind)
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
            if name not in self.rules:  # its schema is still being compiled: the rule reaches itself
                self.is_recursive = True
            return Ref(name)
        target = resolve_pointer(self.root, pointer, ref, path)
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
        self.rules[name] = self.charge(node)
        return Ref(name)

    def enum(self, c: dict, path: str, depth: int) -> Node | None:
        values: list = []
        if "enum" in c:
            if not isinstance(c["enum"], list):
                raise GrammarError(f"'enum' at {path} must be a list")
            values = list(c["enum"])
        if "const" in c:
            const = c["const"]
            values = [const] if "enum" not in c else [v for v in values if json_equal(v, const)]
        if len(values) > MAX_GRAMMAR_NODES:
            raise GrammarError(f"'enum' at {path} has {len(values):,} values; the limit is {MAX_GRAMMAR_NODES:,}")
        rest = {k: v for k, v in c.items() if k not in ("enum", "const")}
        if set(rest) == {"type"}:
            kinds = set(schema_types(rest, path))
            values = [v for v in values if json_type(v) in kinds
                      or (json_type(v) == "integer" and "number" in kinds)]
        elif rest:
            # The values must also satisfy the sibling keywords: check each against their grammar.
            # accepts() is the slow reference matcher, but enum values are few and short.
            check = SchemaCompiler({}, self.root, "", "compact")
            node = check.compile(rest, path, depth)
            if node is None:
                return None
            start = check.fresh("enum_check")
            check.rules[start] = node
            grammar = Grammar(check.rules, start)
            values = [v for v in values if _fits(grammar, v)]
        return _alt_many([self.charge(self.literal(v, path, depth)) for v in values])

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
        if text.isascii():  # one spelling
            return lit(json.dumps(text))
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
                value = self.compile(props[name], f"{path}/properties/{pointer_token(name)}", depth + 1)
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
            key = key_except(names) if names else self.plain_string()
            extra_member = self.share(seq(key, self.colon, extra_value), "extra")
        if "minProperties" in c and count_keyword(c, "minProperties", path) > num_required:
            raise GrammarError(f"'minProperties' at {path} is supported only when the required properties "
                               "already satisfy it")
        if "maxProperties" in c and (extra_member is not None or count_keyword(c, "maxProperties", path) < n):
            raise GrammarError(f"'maxProperties' at {path} is supported only when the listed properties "
                               "cannot exceed it (additionalProperties false)")

        # Linear encoding of optional members (xgrammar's suffix rules): the tail is what may follow once
        # members before j are settled and one was written. A member that may come first (all before it
        # optional) opens the object and jumps into the shared tail after it. The tail is kept as its parts,
        # last first, and made a node only where it is used: prepended to at each member, a node flattened all
        # that followed again (quadratic: 20 members with nested objects were a tenth of nested20's IR time).
        first_required = next((i for i, (_, req) in enumerate(members) if req), None)
        last_first = first_required if first_required is not None else n - 1
        tail_parts: list[Node] = [Repeat(seq(self.comma, extra_member), 0, None)] if extra_member is not None else []
        openers: list[Node] = []
        for j in range(n - 1, -1, -1):
            member, req = members[j]
            if j <= last_first:
                tail = seq(*tail_parts[::-1])
                if j >= 1:  # member j opens the object or follows a comma
                    member = self.share(member, "member")
                    tail = self.share(tail, "tail")
                    tail_parts = [tail]
                openers.append(seq(member, tail))
            if j >= 1:
                step = seq(self.comma, member)
                tail_parts.append(step if req else optional(step))
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
        lo = count_keyword(c, "minItems", path) if "minItems" in c else 0
        hi = count_keyword(c, "maxItems", path) if "maxItems" in c else None
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
        lo = count_keyword(c, "minLength", path) if "minLength" in c else 0
        hi = count_keyword(c, "maxLength", path) if "maxLength" in c else None
        if hi is not None and lo > hi:
            return None
        if "pattern" in c and "format" in c:
            raise GrammarError(f"'pattern' and 'format' together at {path} are not supported")
        if "pattern" in c:
            from .regex import parse_regex  # imported here: the regex front end loads only when needed

            if not isinstance(c["pattern"], str):
                raise GrammarError(f"'pattern' at {path} must be a string")
            try:
                # Every node of the pattern lands in the schema's grammar, so the pattern alone gets the
                # schema's limit: a 20,000-branch pattern stops after half its branches, not at its end.
                content = parse_regex(c["pattern"], max_nodes=MAX_GRAMMAR_NODES)
            except GrammarError as e:
                raise GrammarError(f"{e} (at {path}/pattern)") from e
            content = escape_content(fit_length(content, lo, hi, f"{path}/pattern"), path)
        elif "format" in c:
            make = FORMATS.get(c["format"])
            if make is None:
                raise GrammarError(f"unsupported string format {c['format']!r} at {path}; supported: "
                                   + ", ".join(sorted(FORMATS)))
            content = fit_length(make(), lo, hi, f"{path}/format")
        elif lo == 0 and hi is None:  # one body rule for all (json_strings.STRING_BODY)
            return self.plain_string()
        else:
            content = Repeat(CHAR, lo, hi)
        return seq(lit('"'), content, lit('"'))

    def plain_string(self) -> Node:
        """Any JSON string: its opening quote and a call of the schema's body rule."""
        return seq(lit('"'), Ref(self.string_body()))

    def string_body(self) -> str:
        """The rule of a plain string's body (json_strings.STRING_BODY), made at first use: one for the schema."""
        if not self.string_rule:
            self.string_rule = self.fresh("string")
            self.rules[self.string_rule] = STRING_BODY
        return self.string_rule


def _fits(grammar: Grammar, value: object) -> bool:
    try:
        return accepts(grammar, json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 text spells it
        return False
