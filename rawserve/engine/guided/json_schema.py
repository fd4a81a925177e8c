"""JSON Schema -> grammar IR (response_format json_schema, tool arguments) and the any-JSON-object grammar.

Owns the supported schema subset; json_compiler.py maps each keyword to rules, with json_keywords.py,
json_strings.py, json_numbers.py and json_formats.py. It never validates instances, builds automata or touches
a tokenizer. A schema it cannot enforce exactly is refused with a GrammarError, never loosened.

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
  - Numbers have bounded digits and exact decimal bounds (json_numbers.py says how).
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

from .gbnf import check_grammar
from .grammar import Alt, Grammar, GrammarError, Node, Ref, Repeat, Seq
from .json_compiler import MAX_GRAMMAR_NODES, SchemaCompiler

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
    compiler = SchemaCompiler(rules, True, "", whitespace)
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
    compiler = SchemaCompiler(rules, schema, prefix, whitespace)
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
    # model could never finish. check_grammar finds such rules (and re-checks left recursion). Without a $ref
    # back into a schema still being compiled no rule reaches itself but through any JSON value's rules, which
    # have literal branches and open with a bracket: every rule finishes and none is left-recursive, and the
    # check (a third of nested20's schema-to-IR time) is left out.
    if compiler.is_recursive:
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

