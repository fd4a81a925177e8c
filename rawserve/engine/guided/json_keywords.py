"""What a schema object says, read without building any grammar: the keywords it may hold, the types they imply,
a parent's keywords merged into an anyOf/allOf branch, `$ref` pointers, and JSON equality for enum/const."""
from __future__ import annotations

from .grammar import GrammarError

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "example", "$schema", "$id", "$comment", "strict",
    "deprecated", "readOnly", "writeOnly", "discriminator", "$defs", "definitions"})
CONSTRAINTS = frozenset({
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


def schema_types(c: dict, path: str) -> list[str]:
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


def merge_schemas(base: dict, branch: object, path: str) -> object:
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


def resolve_pointer(root: object, pointer: str, ref: str, path: str) -> object:
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


def pointer_token(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def count_keyword(c: dict, key: str, path: str) -> int:
    value = c[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value % 1:
        raise GrammarError(f"'{key}' at {path} must be a non-negative integer")
    return int(value)


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "?")


def json_equal(a: object, b: object) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b

