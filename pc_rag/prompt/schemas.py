"""JSON schemas as OpenAI's API writes them: ``response_format`` read as a schema, and strict mode
(:func:`closed`). Pure functions of JSON; the grammar they constrain to is :mod:`pc_rag.decode.constrained`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import PromptCacheError


def response_format_schema(response_format: Any) -> dict[str, Any] | bool:
    """OpenAI's ``response_format`` as the engine's ``json_schema``: ``{"type": "json_object"}``
    is True (any JSON object); ``{"type": "json_schema", "json_schema": {"schema": ...}}`` its
    schema, closed to unnamed keys when ``"strict": true`` (OpenAI's strict mode, :func:`closed`)."""
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind == "json_object":
            return True
        spec = response_format.get("json_schema")
        if kind == "json_schema" and isinstance(spec, Mapping) and isinstance(spec.get("schema"), dict):
            return closed(spec["schema"]) if spec.get("strict") is True else spec["schema"]
    raise PromptCacheError("response_format must be {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': "
                           f"{{'schema': {{...}}}}}}, got {response_format!r:.120}")


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing of others closed to
    them (``additionalProperties: false``), as OpenAI's strict mode reads a schema: without it a
    constrained model may add keys the schema never named."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out

