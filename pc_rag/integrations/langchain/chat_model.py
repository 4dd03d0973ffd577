"""``ChatPromptCache``: pc-rag as a LangChain ``BaseChatModel`` (messages rendered with the model's chat
template, tools, structured output, batches run as one engine batch)."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage, ToolMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, Field, SecretStr

from ...callers import StreamingGeneration
from ...decode.logprobs import chat_logprobs
from ...decode.request import Generation as EngineGeneration
from ...engine import PromptCache
from ...errors import PromptCacheError
from ...prompt.schemas import closed, response_format_schema
from ...prompt.tools import call_id, call_schema, parse_calls, resolve_tool_choice
from .._shared import (
    check_document,
    generation_info,
    iterate_in_thread,
)
from .base import EngineParams, scoped
from .errors import langchain_errors


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    return {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool"}.get(message.type, "user")


def _turn(message: BaseMessage) -> dict[str, Any]:
    """A LangChain message as a chat-template turn (tool calls and tool results included)."""
    turn: dict[str, Any] = {"role": _role(message), "content": message.text}
    if isinstance(message, AIMessage) and message.tool_calls:
        turn["tool_calls"] = [{"type": "function", "id": call.get("id"), "function": {"name": call["name"], "arguments": call["args"]}}
                              for call in message.tool_calls]
    if isinstance(message, ToolMessage):
        turn["tool_call_id"] = message.tool_call_id
        if message.name:
            turn["name"] = message.name
    return turn


def _ai_message(result: EngineGeneration, engine: PromptCache, tools: list[dict[str, Any]], logprobs_from: int = 0) -> AIMessage:
    """The reply as an AIMessage: tool calls in ``tool_calls`` when it is one, text otherwise;
    its log-probabilities from entry ``logprobs_from`` on (a stream sent those before)."""
    info = generation_info(result, engine)
    if result.logprobs is not None:  # ChatOpenAI's place and shape for them
        info["logprobs"] = chat_logprobs(result.logprobs[logprobs_from:], engine.tokenizer)
    calls = parse_calls(result.text, tools) if tools else []
    if calls:
        info["finish_reason"] = "tool_calls"
        return AIMessage(content="", tool_calls=[tool_call(name=c["name"], args=c["arguments"], id=call_id()) for c in calls],
                         response_metadata=info, usage_metadata=_usage(result))
    return AIMessage(content=result.text, response_metadata=info, usage_metadata=_usage(result))


def _usage(result: EngineGeneration) -> UsageMetadata:
    """LangChain's standard token counts; ``input_token_details.cache_read`` is the prompt tokens
    whose KV came from the cache (the standard field for exactly this)."""
    prompt = result.stats.cached_tokens + result.stats.computed_tokens
    output = len(result.token_ids)
    return UsageMetadata(input_tokens=prompt, output_tokens=output, total_tokens=prompt + output,
                         input_token_details={"cache_read": result.stats.cached_tokens})


class ChatPromptCache(EngineParams, BaseChatModel):
    """A LangChain chat model served by Prompt Cache.

    Messages are rendered with the model's own chat template. Reuse statistics are in each
    message's ``response_metadata``; token counts in ``usage_metadata``.
    """

    logprobs: bool | None = None
    """Return each generated token's log-probability (the model's raw distribution) in
    ``response_metadata["logprobs"]``, shaped as ChatOpenAI returns them."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """With ``logprobs``: this many most likely tokens at each step besides."""

    # LangChain's standard chat-model parameters; a local model has no use for them
    timeout: float | None = None
    max_retries: int = 0
    api_key: SecretStr | None = None

    @property
    def _llm_type(self) -> str:
        return "pc-rag-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params: dict[str, Any] = {
            "ls_provider": "pc-rag",
            "ls_model_name": kwargs.get("model") or self.model_name,
            "ls_model_type": "chat",
            "ls_temperature": kwargs.get("temperature", self.temperature),
            "ls_max_tokens": kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens)),
        }
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Tools the model may call: LangChain tools, functions, pydantic classes or OpenAI specs.

        ``tool_choice``: "auto" (default: the model answers or calls), "none", "any"/"required"/True
        (a call to some tool) or a tool's name (a call to it). A forced call is decoded under its
        JSON schema, so it always parses into ``AIMessage.tool_calls``. Tools are rendered by the
        chat template when it takes them, else described in the system turn (:mod:`pc_rag.prompt.tools`).
        """
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        return super().bind(tools=formatted, tool_choice=resolve_tool_choice(tool_choice, formatted), **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Replies parsed into ``schema`` (a pydantic class, a TypedDict, or a JSON schema dict).

        ``method="json_schema"`` (default) constrains decoding to the schema, so the reply always
        parses (unless ``max_new_tokens`` ends it first); ``"function_calling"`` forces a call to a
        tool of that schema (also constrained); ``"json_mode"`` constrains to some JSON object and
        leaves the keys to the prompt. ``include_raw=True`` returns ``{"raw", "parsed",
        "parsing_error"}``. ``strict`` (default on; ``False`` turns it off): objects whose schema
        does not say otherwise get no keys beyond their properties, as in OpenAI's strict mode.
        """
        if kwargs:
            raise PromptCacheError(f"unknown with_structured_output arguments: {', '.join(sorted(kwargs))}")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser: Runnable
        if method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict}, "schema": tool})
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic  # type: ignore[list-item]
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            json_schema = convert_to_json_schema(schema)
            constraint = json_schema if strict is False else closed(json_schema)
            response_format = ({"type": "json_object"} if method == "json_mode"
                               else {"type": "json_schema", "json_schema": {"name": json_schema.get("title", "output"), "schema": constraint}})
            llm = self.bind(response_format=response_format, ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict}, "schema": json_schema})
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise PromptCacheError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
                 ) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
        """The prompt, the engine's arguments and the tools in force for one conversation."""
        kwargs = dict(kwargs)
        tools = list(kwargs.pop("tools", None) or [])
        choice = resolve_tool_choice(kwargs.pop("tool_choice", None), tools)
        response_format = kwargs.pop("response_format", None)
        logprobs, top = kwargs.pop("logprobs", self.logprobs), kwargs.pop("top_logprobs", self.top_logprobs)
        if choice == "none":
            tools = []
        params = self._engine_kwargs(stop, kwargs)
        if logprobs:
            params["logprobs"] = top or 0
        elif top is not None:
            raise PromptCacheError("top_logprobs needs logprobs=True")
        if choice not in ("auto", "none"):
            params["json_schema"] = call_schema(tools, None if choice == "required" else choice)
        if response_format is not None:
            if "json_schema" in params:
                raise PromptCacheError("give a forced tool_choice or a response_format, not both")
            params["json_schema"] = response_format_schema(response_format)
        prompt = self.engine.render_chat([_turn(m) for m in messages], tools=tools or None)
        return prompt, params, tools

    @langchain_errors
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            return _chat_result(list(self._stream(messages, stop, run_manager, **kwargs)))
        prompt, params, tools = self._request(messages, stop, kwargs)
        result = _batched(self, prompt) or self.engine.generate(prompt, **params)
        check_document(result, self.engine, params)
        message = _ai_message(result, self.engine, tools)
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=dict(message.response_metadata))])

    @langchain_errors
    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        prompt, params, tools = self._request(messages, stop, kwargs)
        stream: StreamingGeneration = self.engine.stream(prompt, **params)
        sent = 0  # log-probability entries streamed: a piece carries those of the tokens it completes
        for text in stream:
            if tools:  # the reply may be a call: read whole before it is sent
                continue
            logged = getattr(text, "logprobs", None)
            metadata = {} if logged is None else {"logprobs": chat_logprobs(logged, self.engine.tokenizer)}
            sent += len(logged or ())
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=str(text), response_metadata=metadata))
            if run_manager is not None:
                run_manager.on_llm_new_token(str(text), chunk=chunk)
            yield chunk
        assert stream.result is not None
        check_document(stream.result, self.engine, params)
        message = _ai_message(stream.result, self.engine, tools, logprobs_from=sent)
        if tools:
            chunk = ChatGenerationChunk(message=AIMessageChunk(
                content=message.content,
                tool_call_chunks=[tool_call_chunk(name=c["name"], args=json.dumps(c["args"], ensure_ascii=False), id=c["id"], index=i)
                                  for i, c in enumerate(message.tool_calls)]))
            if run_manager is not None:
                run_manager.on_llm_new_token(message.text, chunk=chunk)
            yield chunk
        yield ChatGenerationChunk(message=AIMessageChunk(content="", response_metadata=message.response_metadata,
                                                         usage_metadata=message.usage_metadata, chunk_position="last"))

    def batch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Several conversations decoded together (``engine.generate_batch``: one forward pass per
        step for all), as :class:`PromptCacheLLM` batches prompts. Callbacks, tracing and
        LangChain's response cache see one run per conversation, as with ``invoke``."""
        if self.streaming or return_exceptions or len(inputs) < 2 or isinstance(config, list):
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        kwargs = scoped(config, kwargs)
        config = ensure_config(config)
        conversations = [self._convert_input(item).to_messages() for item in inputs]
        stop = kwargs.pop("stop", None)
        requests = [self._request(messages, stop, {k: v for k, v in kwargs.items() if k != "ls_structured_output_format"})
                    for messages in conversations]
        _pending.batch = _Batch(self, [prompt for prompt, _, _ in requests], requests[0][1])
        try:
            result = self.generate(conversations, stop=stop, callbacks=config.get("callbacks"), tags=config.get("tags"),
                                   metadata=config.get("metadata"), run_name=config.get("run_name"), **kwargs)
        finally:
            _pending.batch = None
        return [generations[0].message for generations in result.generations]  # type: ignore[attr-defined]

    @langchain_errors
    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """:meth:`_generate` for asyncio: the request waits on the engine's scheduler
        (``engine.agenerate``), so the event loop never waits on a forward pass, concurrent
        calls are batched, and a cancelled call frees its row."""
        if self.streaming:
            chunks = [chunk async for chunk in self._astream(messages, stop, run_manager, **kwargs)]
            return _chat_result(chunks)
        prompt, params, tools = self._request(messages, stop, kwargs)
        result = await self.engine.agenerate(prompt, **params)
        check_document(result, self.engine, params)
        message = _ai_message(result, self.engine, tools)
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=dict(message.response_metadata))])

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """Pieces as they are decoded, by a worker thread; the loop stays free between them."""
        async for chunk in iterate_in_thread(self._stream(messages, stop, None, **kwargs)):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


class _Batch:
    """A ``ChatPromptCache.batch`` in progress on this thread: its prompts decode together the
    first time one of them is asked for (LangChain then asks for each in turn)."""

    def __init__(self, model: ChatPromptCache, prompts: list[str], kwargs: dict[str, Any]) -> None:
        self.model, self.prompts, self.kwargs = model, prompts, kwargs
        self.results: dict[str, list[EngineGeneration]] | None = None

    def take(self, prompt: str) -> EngineGeneration | None:
        if prompt not in self.prompts:
            return None
        if self.results is None:
            self.results = {}
            for text, result in zip(self.prompts, self.model.engine.generate_batch(self.prompts, **self.kwargs)):
                self.results.setdefault(text, []).append(result)
        return self.results[prompt].pop(0) if self.results.get(prompt) else None


_pending = threading.local()


def _batched(model: ChatPromptCache, prompt: str) -> EngineGeneration | None:
    batch: _Batch | None = getattr(_pending, "batch", None)
    return batch.take(prompt) if batch is not None and batch.model is model else None


def _chat_result(chunks: list[ChatGenerationChunk]) -> ChatResult:
    """One message from streamed chunks (text joined; metadata and usage from the last)."""
    message = chunks[0].message
    for chunk in chunks[1:]:
        message = message + chunk.message  # type: ignore[assignment]
    final = AIMessage(content=message.content, response_metadata=message.response_metadata, usage_metadata=message.usage_metadata,
                      tool_calls=getattr(message, "tool_calls", []))
    return ChatResult(generations=[ChatGeneration(message=final, generation_info=dict(message.response_metadata))])
