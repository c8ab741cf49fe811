"""What an answer must be, as the regular expression it must match whole: JSON a schema
validates, any JSON object, or one of a list of strings. outlines-core writes a schema's pattern
(no MLX: a job file is checked with these); `salabatch.engine.grammar` compiles a pattern against
a tokenizer's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from outlines_core.json_schema import build_regex_from_schema

ANY_OBJECT = {"type": "object"}  # what `json_object` asks for (objects nested 3 deep at most)


# The keywords whose constraint outlines-core writes into its pattern (checked against
# outlines-core 0.2: each changes the pattern, or is what it does by default, as
# `additionalProperties: false`), each with how its value holds subschemas: "schema" one, "list"
# a list of them, "map" a name → schema object; None: no subschema. `oneOf` is written as
# `anyOf` (exact where its branches exclude each other, as a discriminated union's).
_ENFORCED = {
    "type": None, "enum": None, "const": None, "format": None, "pattern": None,
    "minLength": None, "maxLength": None, "minItems": None, "maxItems": None,
    "required": None, "$ref": None,
    "properties": "map", "$defs": "map", "definitions": "map",
    "additionalProperties": None, "items": "schema",  # additionalProperties: false only
    "prefixItems": "list", "anyOf": "list", "oneOf": "list", "allOf": "list",
}  # fmt: skip
# The `format`s whose pattern is exact and ASCII (outlines-core's `date` takes any Unicode digit,
# its `uri` and `email` characters that JSON text must escape).
_FORMATS = ("uuid", "time", "date-time")
# JSON types, as `type` names them, of Python's JSON values
_TYPES = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "null": (type(None),), "object": (dict,), "array": (list,),
}  # fmt: skip
# Annotations: they constrain nothing, so a pattern that ignores them is exact.
_ANNOTATIONS = frozenset(
    {"$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples",
     "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "strict"}
)  # fmt: skip


def schema_pattern(schema: dict) -> str:
    """The pattern of JSON text `schema` validates, its objects' keys in the schema's order (as
    OpenAI's structured outputs write them: a `reasoning` key before `answer` has the model
    reason first); ValueError saying why outlines-core cannot write one, or naming a keyword it
    would leave out (`minimum`, `uniqueItems`, `not`, ...: answers that break it would pass)."""
    _check_keywords(schema, "")
    try:
        return build_regex_from_schema(json.dumps(schema))
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"the JSON schema cannot be used ({e})") from None


def _check_keywords(schema: object, where: str) -> None:
    """ValueError for the first keyword under `schema` (at `where`, a dotted path) that the
    pattern would not enforce."""
    if not isinstance(schema, dict):
        return  # true / false, or a value outlines-core refuses itself
    if problem := _combination_problem(schema):
        at = f"{where}: " if where else ""
        raise ValueError(f"the JSON schema cannot be used: {at}{problem}")
    for key, value in schema.items():
        at = f"{where}.{key}" if where else key
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            raise ValueError(
                f"the JSON schema cannot be used: {at} is a keyword the grammar does not "
                f"enforce (it does: {', '.join(_ENFORCED)})"
            )
        holds = _ENFORCED[key]
        if holds == "schema":
            _check_keywords(value, at)
        elif holds == "list" and isinstance(value, list):
            for i, sub in enumerate(value):
                _check_keywords(sub, f"{at}[{i}]")
        elif holds == "map" and isinstance(value, dict):
            for name, sub in value.items():
                _check_keywords(sub, f"{at}.{name}")


def _combination_problem(schema: dict) -> str | None:
    """What outlines-core's pattern of `schema` would not hold: answers that break it would pass
    (or, for allOf, no answer would be JSON: it writes the branches one after another)."""
    if isinstance(all_of := schema.get("allOf"), list) and len(all_of) > 1:
        return "allOf of more than one schema is not enforced (merge them into one)"
    if schema.get("additionalProperties", False) is not False:
        return "additionalProperties is enforced as false only (no key past properties)"
    required, properties = schema.get("required"), schema.get("properties") or {}
    if isinstance(required, list) and (extra := [k for k in required if k not in properties]):
        return f"required names {extra[0]!r}, not in properties (add it there)"
    if "prefixItems" in schema and ("minItems" in schema or "maxItems" in schema):
        return "minItems/maxItems beside prefixItems are not enforced"
    if "format" in schema and schema["format"] not in _FORMATS:
        return f"format {schema['format']!r} is not enforced (it is: {', '.join(_FORMATS)})"
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    enum = schema.get("enum")
    values = (enum if isinstance(enum, list) else []) + (
        [schema["const"]] if "const" in schema else []
    )
    if isinstance(types, list) and all(t in _TYPES for t in types):
        for value in values:
            if not any(_is(value, t) for t in types):
                return f"enum/const value {value!r} is not of its type {schema['type']!r}"
    return None


def _is(value: object, json_type: str) -> bool:
    """Whether `value` is of JSON type `json_type` (a bool is no number, 1.0 an integer)."""
    if isinstance(value, bool):
        return json_type == "boolean"
    if json_type == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, _TYPES[json_type])


def choice_pattern(choices: Sequence[str]) -> str:
    """The pattern of exactly one of `choices`."""
    return "|".join(f"({_literal(c)})" for c in choices)


def _literal(text: str) -> str:
    """`text` as a pattern that matches it literally: every ASCII character but letters,
    digits, space and `_` as its hex escape (`\\x3c`), since a backslash before some of them
    means something else in outlines-core's regex syntax (`\\<`: the start of a word)."""
    return "".join(
        c if c.isalnum() or c in " _" or not c.isascii() else f"\\x{ord(c):02x}" for c in text
    )
