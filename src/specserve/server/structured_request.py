"""The request fields that ask for structured output, in the spellings clients send, as one GrammarSpec.

* OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}`` (``{"type": "text"}`` is free text). llama-server's ``{"type":
  "json_object", "schema": {...}}`` is a schema too.
* vLLM: ``structured_outputs`` ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``, and its
  older top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

At most one constraint per request (two are a 400, as in vLLM); the grammar itself is checked when it is
compiled (structured/grammar.py), also a 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from specserve.request import GrammarSpec
from specserve.server.strict import StrictModel

MAX_GRAMMAR_CHARS = 200_000


class JsonSchemaFormat(StrictModel):
    name: str | None = Field(None, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """llama-server's spelling: a schema beside ``type: json_object``."""


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs`` (``guided_decoding`` before it)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


def _schema_text(schema: Any) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _specs(outputs: StructuredOutputs, field: str) -> list[tuple[str, GrammarSpec]]:
    """The constraints ``outputs`` holds, each named as the request spelled it (``field`` % its key)."""
    options = {
        "json": None if outputs.json_ is None else GrammarSpec("json_schema", _schema_text(outputs.json_)),
        "regex": None if outputs.regex is None else GrammarSpec("regex", outputs.regex),
        "choice": None if outputs.choice is None else GrammarSpec("choice", json.dumps(outputs.choice)),
        "grammar": None if outputs.grammar is None else GrammarSpec("grammar", outputs.grammar),
        "json_object": GrammarSpec("json_object") if outputs.json_object else None,
    }
    return [(field % key, spec) for key, spec in options.items() if spec is not None]


def grammar_spec(
    response_format: ResponseFormat | None,
    structured: StructuredOutputs | None,
    legacy: StructuredOutputs | None = None,
) -> GrammarSpec | None:
    """The request's one constraint, or None; ValueError naming the fields when there are several.
    ``legacy`` holds the ``guided_*`` fields, the same constraints under vLLM's older names."""
    found: list[tuple[str, GrammarSpec]] = []
    if response_format is not None and response_format.type != "text":
        nested = response_format.json_schema
        schema = nested.schema_ if nested is not None else response_format.schema_
        if response_format.type == "json_schema" and nested is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object")
        if schema is None or schema is True or schema == {}:
            found.append(("response_format", GrammarSpec("json_object")))
        else:
            found.append(("response_format", GrammarSpec("json_schema", _schema_text(schema))))
    if structured is not None:
        found += _specs(structured, "structured_outputs.%s")
    if legacy is not None:
        found += _specs(legacy, "guided_%s")
    if len(found) > 1:
        raise ValueError(
            f"only one structured output constraint per request; got {', '.join(n for n, _ in found)}"
        )
    if not found:
        return None
    spec = found[0][1]
    if len(spec.text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the grammar has more than {MAX_GRAMMAR_CHARS} characters")
    return spec
