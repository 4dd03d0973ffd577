"""The chat template as pc-rag reads it: the role markers PML's role tags become
(:func:`chat_markers`), and conversations rendered with tools (:func:`render_chat`; the tool
calls' schema and parsing are in :mod:`pc_rag.prompt.tools`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import PromptCacheError
from .layout import ChatMarkers

logger = logging.getLogger(__name__)


_FALLBACK_MARKERS = ChatMarkers(
    starts={"system": "System: ", "user": "User: ", "assistant": "Assistant: "},
    ends={"system": "\n", "user": "\n", "assistant": "\n"},
    generation="Assistant:",
)


def chat_markers(tokenizer: Any) -> ChatMarkers:
    """Role markers derived from the tokenizer's own chat template.

    Each role is rendered after a fixed system turn and the difference is split around a
    sentinel content. Templates that cannot be split that way (e.g. ones that fold the system
    prompt into the first user turn) fall back to plain ``Role: text`` markers, with a warning.
    """
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("the tokenizer has no chat_template: role tags use plain 'User: ' style markers")
        return _FALLBACK_MARKERS
    sentinel = "\x00PCRAG\x00"

    def render(messages: list[dict[str, str]], generation: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    try:
        system = [{"role": "system", "content": sentinel}]
        sys_text = render(system)
        starts: dict[str, str] = {}
        ends: dict[str, str] = {}
        starts["system"], ends["system"] = sys_text.split(sentinel)
        history = list(system)
        for role in ("user", "assistant"):
            turn = history + [{"role": role, "content": sentinel}]
            text = render(turn)
            before = render(history)
            if not text.startswith(before) or text[len(before) :].count(sentinel) != 1:
                raise ValueError(f"{role} turn is not appended verbatim")
            starts[role], ends[role] = text[len(before) :].split(sentinel)
            history = turn
        conversation = system + [{"role": "user", "content": sentinel}]
        plain = render(conversation)
        with_prompt = render(conversation, generation=True)
        if not with_prompt.startswith(plain):
            raise ValueError("generation prompt is not appended verbatim")
        # what the template writes before the first user turn of a conversation without a system
        # prompt (some insert a default one): the meaning of a bare <system/>
        opening = render([{"role": "user", "content": sentinel}]).split(sentinel)[0]
        no_system = opening[: -len(starts["user"])] if starts["user"] and opening.endswith(starts["user"]) else ""
        return ChatMarkers(starts, ends, with_prompt[len(plain) :], no_system)
    except Exception as exc:  # noqa: BLE001 - any template failure means: use the fallback
        logger.warning("cannot derive role markers from the chat template (%s): using plain markers", exc)
        return _FALLBACK_MARKERS

def render_chat(tokenizer: Any, markers: ChatMarkers, messages: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """``[{"role", "content"}]`` rendered by the tokenizer's chat template (or ``markers`` when it
    has none), ending with the generation prompt.

    ``tools`` (OpenAI-style function specs) go to templates that render them; otherwise into the
    system turn (:data:`pc_rag.prompt.tools.TOOLS_SYSTEM_TEXT`). An assistant message may carry
    ``tool_calls`` (``[{"function": {"name", "arguments"}}]``), a ``tool`` message the result:
    templates that know tools render them their way, the others read each call as the JSON
    object the model is asked to write.
    """
    rendered: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise PromptCacheError(f"message {index} needs a str 'role' and a str 'content', got {message!r:.120}")
        turn: dict[str, Any] = {"role": role, "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if message.get(key):
                turn[key] = message[key]
        rendered.append(turn)
    if not rendered:
        raise PromptCacheError("no messages to render")
    template = bool(getattr(tokenizer, "chat_template", None))
    if not (template and _template_renders_tools(tokenizer)):
        rendered = _tools_as_text(rendered, tools or ())
    if template:
        return tokenizer.apply_chat_template(rendered, tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=True)
    parts = [markers.starts.get(m["role"], markers.starts["user"]) + m["content"] + markers.ends.get(m["role"], markers.ends["user"])
             for m in rendered]
    return "".join(parts) + markers.generation


_RENDERS_TOOLS: dict[str, bool] = {}  # chat template text -> whether it writes tools


def _template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes ``tools`` into the prompt (probed once per template text,
    so a template replaced on the tokenizer is probed again)."""
    template = str(tokenizer.chat_template)
    cached = _RENDERS_TOOLS.get(template)
    if cached is None:
        probe = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "pc_rag_probe_tool", "description": "probe", "parameters": {"type": "object", "properties": {}}}}
        try:
            cached = "pc_rag_probe_tool" in tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            cached = False
        _RENDERS_TOOLS[template] = cached
    return cached


def _tools_as_text(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: their description in the system turn, each
    earlier call as the JSON object the model is asked to write."""
    from .tools import system_text

    plain = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        message.pop("tool_call_id", None)
        message.pop("name", None)
        if calls:
            written = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                       for c in calls]
            message["content"] = "\n".join(([message["content"]] if message["content"] else []) + written)
        plain.append(message)
    if tools:
        description = system_text(tools)
        if plain[0]["role"] == "system":
            plain[0] = {**plain[0], "content": plain[0]["content"] + "\n\n" + description}
        else:
            plain.insert(0, {"role": "system", "content": description})
    return plain
