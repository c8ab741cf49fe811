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
    "minProperties": None, "required": None, "$ref": None,
    "properties": "map", "$defs": "map", "definitions": "map",
    "additionalProperties": "schema", "items": "schema",
    "prefixItems": "list", "anyOf": "list", "oneOf": "list", "allOf": "list",
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
