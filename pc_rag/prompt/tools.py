"""Tool calling over a chat template: tools described to the model, its calls constrained and read back.

Tools are OpenAI-style function specs (``{"type": "function", "function": {"name",
"description", "parameters"}}``, what LangChain's ``convert_to_openai_tool`` and LlamaIndex's
``to_openai_tool`` produce). A call is the JSON object ``{"name": ..., "arguments": {...}}``.

- Templates that take ``tools`` (Qwen2.5, Llama 3.1, Mistral, Hermes, ...) render them their way;
  for the others the tools go into the system turn as :data:`TOOLS_SYSTEM_TEXT` (SmolLM2's
  template is one of them).
- A forced call (``tool_choice`` "required"/"any" or a tool's name) is decoded under the JSON
  schema of :func:`call_schema`: it always parses and always names a bound tool with arguments
  of its schema (closed: no argument the schema does not name). With "auto" the model writes text or a call, read back by :func:`parse_calls`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import PromptCacheError
from .schemas import closed

TOOLS_SYSTEM_TEXT = (
    "You can call the following tools. Their JSON schemas:\n{tools}\n"
    'To call a tool, reply with only a JSON object: {{"name": <tool name>, "arguments": <an object of its arguments>}}.'
)


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The functions' names; an error for anything that is not an OpenAI-style function tool."""
    names = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise PromptCacheError(f"tool {index} is not an OpenAI-style function spec "
                                   f"({{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}): {tool!r:.120}")
        names.append(function["name"])
    return names


def resolve_tool_choice(choice: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """LangChain's, LlamaIndex's and OpenAI's ``tool_choice`` spellings as "auto", "none",
    "required" or a bound tool's name (``{"type": "function", "function": {"name": ...}}`` too)."""
    if choice is None or choice == "auto":
        return "auto"
    if choice == "none":
        return "none"
    if choice is True or choice in ("any", "required"):
        return "required"
    if isinstance(choice, Mapping):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in tool_names(tools):
        return choice
    raise PromptCacheError(f"tool_choice must be 'auto', 'none', 'any'/'required'/True or a bound tool's name "
                           f"({', '.join(tool_names(tools))}), got {choice!r}")


def call_id() -> str:
    """A fresh id for a tool call, as OpenAI writes them."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_schema(tools: Sequence[Mapping[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools`` (or to the one named ``name``)."""
    names = tool_names(tools)
    if not names:
        raise PromptCacheError("a forced tool call needs tools: bind some (bind_tools) or use tool_choice='auto'")
    if name is not None and name not in names:
        raise PromptCacheError(f"tool_choice names {name!r}, which is not a bound tool (bound: {', '.join(names)})")
    options = []
    for tool_name, tool in zip(names, tools):
        if name is not None and tool_name != name:
            continue
        parameters = closed(tool["function"].get("parameters") or {"type": "object", "properties": {}})
        options.append({
            "type": "object",
            "properties": {"name": {"const": tool_name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return options[0] if len(options) == 1 else {"anyOf": options}


def system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-turn description of ``tools`` for templates that do not render tools."""
    tool_names(tools)
    return TOOLS_SYSTEM_TEXT.format(tools="\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools))


def parse_calls(text: str, tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls in a reply: the whole reply as one call object (or a list of them), or
    ``<tool_call>...</tool_call>`` blocks as tool-trained templates write them. Only calls that
    name a bound tool with an arguments object count; anything else is text (an empty list)."""
    names = set(tool_names(tools))
    stripped = text.strip()
    candidates: list[Any] = []
    if "<tool_call>" in stripped:
        for block in stripped.split("<tool_call>")[1:]:
            candidates.append(_loads(block.split("</tool_call>")[0]))
    else:
        found = _loads(stripped)
        candidates.extend(found if isinstance(found, list) else [found])
    calls = []
    for found in candidates:
        if not isinstance(found, dict):
            return []
        arguments = found.get("arguments", found.get("parameters"))
        name = found.get("name")
        if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
            return []
        calls.append({"name": name, "arguments": arguments})
    return calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None
