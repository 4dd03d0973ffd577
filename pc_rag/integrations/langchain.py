"""LangChain adapters: an LLM, a chat model and a retriever over a :class:`~pc_rag.PromptCache`.

Thin by design: prompts go to the engine as plain text (in which module references and verbatim
document text are reused; PML only with ``pml=True``), and the engine's reuse statistics come back
in ``generation_info`` / ``response_metadata``.

Two ways to feed documents to a chain:

- ``format_modules`` (references): ``{"context": retriever | format_modules, "question":
  RunnablePassthrough()} | prompt | llm`` puts references to the retrieved modules into the
  prompt; the engine imports their KV and never re-tokenises their text.
- unchanged "stuff" chains (drop-in): document text formatted into the prompt is found by the
  engine's text index and its KV reused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForLLMRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, BaseLLM, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage, ToolMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, Generation, GenerationChunk, LLMResult
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from langchain_core.vectorstores import VectorStore
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr

from ..prompt.schemas import closed, response_format_schema
from ..prompt.documents import document_id, is_reference, module_reference
from ..engine import PromptCache
from ..errors import PromptCacheError
from ..decode.request import Generation as EngineGeneration
from ..decode.request import StreamingGeneration
from ..retrievers.faiss_retriever import FaissModuleRetriever
from ..prompt.tools import call_id, call_schema, parse_calls, resolve_tool_choice
from ._shared import (
    as_modules,
    as_prompt,
    check_document,
    check_encode,
    engine_kwargs,
    generation_info,
    iterate_in_thread,
    model_name,
    narrow,
    reordered,
    shared_engine,
    target_collection,
)
from .langchain_vectorstore import PromptCacheVectorStore, SentenceTransformerEmbeddings

__all__ = ["ChatPromptCache", "PromptCacheLLM", "PromptCacheRetriever", "PromptCacheVectorStore", "SentenceTransformerEmbeddings",
           "format_modules"]


class _EngineParams(BaseModel):
    """Fields and helpers shared by the LLM and the chat model."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    engine: Any = Field(default=None, exclude=True)
    """The :class:`~pc_rag.PromptCache`; built from ``model`` (default: the embedded model) when omitted."""
    model: str | None = None
    """Hub id or local folder used when no ``engine`` is given."""
    max_new_tokens: int = Field(default=256, ge=1, validation_alias=AliasChoices("max_new_tokens", "max_tokens"))
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = None
    stop: list[str] | None = None
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """transformers' repetition penalty (>1 discourages repeating tokens; small instruct models loop without it)."""
    no_repeat_ngram_size: int = Field(default=0, ge=0)
    """Never repeat an n-gram of this size (0: off), as in transformers."""
    use_cache: bool = True
    """False runs full prefill of the same tokens (the baseline)."""
    streaming: bool = False
    """When True, ``invoke`` decodes through the streaming path (callbacks see every token)."""
    pml: bool = False
    """Read prompts that are PML (``<prompt schema=...>``) as markup (:class:`PromptCacheLLM`). Off
    (the default), a prompt is plain text whatever it contains, so nothing a chain passes in can
    import a module by writing markup. :class:`ChatPromptCache` renders messages: always text."""
    collections: list[str] | None = None
    """The collections (document collections, PML schemas) this model's requests may read; None:
    all of them. Per call, ``config={"configurable": {"collections": [...]}}`` (or
    ``collections=`` as an invoke keyword) narrows it, never widens it. Nothing outside them is
    imported, matched by drop-in or reported (see :meth:`pc_rag.PromptCache.plan`)."""

    pipeline_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Generation arguments for every call (per-call keywords win), as ``HuggingFacePipeline``'s:
    ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ..."""

    @classmethod
    def from_model_id(cls, model_id: str, *, model_kwargs: dict[str, Any] | None = None,
                      pipeline_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Built like ``HuggingFacePipeline.from_model_id``: ``model_kwargs`` go to
        :meth:`PromptCache.from_pretrained` (``revision``, ``dtype``, ``device_map``,
        ``kv_dir``, ``recovery``, ...), ``pipeline_kwargs`` to every generation."""
        engine = PromptCache.from_pretrained(model_id, **(model_kwargs or {}))
        return cls(engine=engine, model=model_id, pipeline_kwargs=dict(pipeline_kwargs or {}), **kwargs)

    def model_post_init(self, context: Any) -> None:
        if self.engine is None:
            self.engine = shared_engine(self.model)
        elif not isinstance(self.engine, PromptCache):
            raise PromptCacheError(f"engine must be a pc_rag.PromptCache, got {type(self.engine).__name__}")

    def _engine_kwargs(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        # LangChain passes ``model`` to tracing (see _get_ls_params); it does not select a model here
        return engine_kwargs(self, {**self.pipeline_kwargs, **kwargs}, stop if stop is not None else self.stop, ignored=("model",))

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """Everything that changes an answer: LangChain's response cache keys on it (``llm_string``),
        so a full-prefill answer is never served for a cached one, nor one recovery for another."""
        engine = self.engine
        return {
            "model_name": self.model_name,
            "engine_fingerprint": engine.fingerprint,
            "encoding": engine.encoding,
            "recompute": engine.recompute,
            "recompute_tail": engine.recompute_tail,
            "recovery": dataclasses.asdict(engine.recovery),
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "repetition_penalty": self.repetition_penalty,
            "no_repeat_ngram_size": self.no_repeat_ngram_size,
            "use_cache": self.use_cache,
            "pml": self.pml,
            "collections": self.collections,
            "pipeline_kwargs": dict(sorted(self.pipeline_kwargs.items())),
        }

    @property
    def model_name(self) -> str:
        return model_name(self.engine)

    # per-call scope from LangChain's config: ``configurable["collections"]`` becomes the call's
    # ``collections=`` keyword (BaseLLM/BaseChatModel hand a config's callbacks and tags on, not
    # its configurable)
    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:  # noqa: A002 - LangChain's name
        return super().invoke(input, config, **_scoped(config, kwargs))  # type: ignore[misc]

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:  # noqa: A002
        return await super().ainvoke(input, config, **_scoped(config, kwargs))  # type: ignore[misc]

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> Iterator[Any]:  # noqa: A002
        yield from super().stream(input, config, **_scoped(config, kwargs))  # type: ignore[misc]

    async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:  # noqa: A002
        async for chunk in super().astream(input, config, **_scoped(config, kwargs)):  # type: ignore[misc]
            yield chunk

    def batch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        if isinstance(config, list) and len({repr(_config_scope(c)) for c in config}) > 1:  # several scopes: one call each
            return [self.invoke(i, c, **kwargs) for i, c in zip(inputs, config)]
        first = config[0] if isinstance(config, list) and config else config
        return super().batch(inputs, config, return_exceptions=return_exceptions, **_scoped(first, kwargs))  # type: ignore[misc]

    async def abatch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        if isinstance(config, list) and len({repr(_config_scope(c)) for c in config}) > 1:
            return [await self.ainvoke(i, c, **kwargs) for i, c in zip(inputs, config)]
        first = config[0] if isinstance(config, list) and config else config
        return await super().abatch(inputs, config, return_exceptions=return_exceptions, **_scoped(first, kwargs))  # type: ignore[misc]


def _config_scope(config: Any) -> Any:
    """``config["configurable"]["collections"]`` (None when absent)."""
    if not isinstance(config, dict):
        return None
    return (config.get("configurable") or {}).get("collections")


def _scoped(config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the config's scope narrowing its ``collections`` (see :func:`narrow`)."""
    from_config = _config_scope(config)
    if from_config is None:
        return kwargs
    return {**kwargs, "collections": narrow(kwargs.get("collections"), from_config)}


class PromptCacheLLM(_EngineParams, BaseLLM):
    """A LangChain LLM (text in, text out) served by Prompt Cache.

    ``PromptCacheLLM(engine=engine, max_new_tokens=128)``. The prompt is used as given, like
    ``HuggingFacePipeline`` does (no chat template; use :class:`ChatPromptCache` for that).
    Reuse statistics are in each generation's ``generation_info``.
    """

    @property
    def _llm_type(self) -> str:
        return "pc-rag"

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations: list[list[Generation]] = []
        if self.streaming:
            for prompt in prompts:
                chunks = list(self._stream(prompt, stop, run_manager, **kwargs))
                text = "".join(c.text for c in chunks)
                generations.append([Generation(text=text, generation_info=chunks[-1].generation_info)])
            return self._result(generations)
        # several prompts (LLM.batch / generate) decode together: one forward pass per step for all
        texts = [as_prompt(p, self.pml) for p in prompts]
        return self._results(self.engine.generate_batch(texts, **self._engine_kwargs(stop, kwargs)))

    def _results(self, results: list[EngineGeneration]) -> LLMResult:
        return self._result([[Generation(text=r.text, generation_info=generation_info(r, self.engine))] for r in results])

    def _result(self, generations: list[list[Generation]]) -> LLMResult:
        usage = _token_usage([g[0].generation_info or {} for g in generations])
        return LLMResult(generations=generations, llm_output={"model_name": self.model_name, "token_usage": usage})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        stream: StreamingGeneration = self.engine.stream(as_prompt(prompt, self.pml), **self._engine_kwargs(stop, kwargs))
        for text in stream:
            chunk = GenerationChunk(text=text)
            if run_manager is not None:
                run_manager.on_llm_new_token(text, chunk=chunk)
            yield chunk
        assert stream.result is not None
        yield GenerationChunk(text="", generation_info=generation_info(stream.result, self.engine))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """:meth:`_generate` for asyncio: each prompt waits on the engine's scheduler
        (``engine.agenerate``), so the event loop never waits on a forward pass, concurrent calls
        are batched, and a cancelled call frees its rows."""
        if self.streaming:
            generations: list[list[Generation]] = []
            for prompt in prompts:
                chunks = [chunk async for chunk in self._astream(prompt, stop, run_manager, **kwargs)]
                generations.append([Generation(text="".join(c.text for c in chunks), generation_info=chunks[-1].generation_info)])
            return self._result(generations)
        params = self._engine_kwargs(stop, kwargs)
        return self._results(list(await asyncio.gather(*(self.engine.agenerate(as_prompt(p, self.pml), **params) for p in prompts))))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        """Pieces as they are decoded, by a worker thread; the loop stays free between them."""
        async for chunk in iterate_in_thread(self._stream(prompt, stop, None, **kwargs)):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


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


def _ai_message(result: EngineGeneration, engine: PromptCache, tools: list[dict[str, Any]]) -> AIMessage:
    """The reply as an AIMessage: tool calls in ``tool_calls`` when it is one, text otherwise."""
    info = generation_info(result, engine)
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


def _token_usage(infos: Sequence[dict[str, Any]]) -> dict[str, int]:
    """``llm_output["token_usage"]`` of an LLM call, summed over its prompts' ``generation_info``."""
    prompt = sum(i["cached_tokens"] + i["computed_tokens"] for i in infos)
    completion = sum(i["generated_tokens"] for i in infos)
    cached = sum(i["cached_tokens"] for i in infos)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "cached_tokens": cached}


class ChatPromptCache(_EngineParams, BaseChatModel):
    """A LangChain chat model served by Prompt Cache.

    Messages are rendered with the model's own chat template. Reuse statistics are in each
    message's ``response_metadata``; token counts in ``usage_metadata``.
    """

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
        if choice == "none":
            tools = []
        params = self._engine_kwargs(stop, kwargs)
        if choice not in ("auto", "none"):
            params["json_schema"] = call_schema(tools, None if choice == "required" else choice)
        if response_format is not None:
            if "json_schema" in params:
                raise PromptCacheError("give a forced tool_choice or a response_format, not both")
            params["json_schema"] = response_format_schema(response_format)
        prompt = self.engine.render_chat([_turn(m) for m in messages], tools=tools or None)
        return prompt, params, tools

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

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        prompt, params, tools = self._request(messages, stop, kwargs)
        stream: StreamingGeneration = self.engine.stream(prompt, **params)
        for text in stream:
            if tools:  # the reply may be a call: read whole before it is sent
                continue
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
            if run_manager is not None:
                run_manager.on_llm_new_token(text, chunk=chunk)
            yield chunk
        assert stream.result is not None
        check_document(stream.result, self.engine, params)
        message = _ai_message(stream.result, self.engine, tools)
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
        kwargs = _scoped(config, kwargs)
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


class PromptCacheRetriever(BaseRetriever):
    """A LangChain retriever whose documents are pre-encoded modules.

    Over pc-rag's own index (a :class:`~pc_rag.retrievers.FaissModuleRetriever`, the default:
    one over the shared default engine's documents), or over any LangChain retriever the user
    already has: ``PromptCacheRetriever(retriever=chroma.as_retriever())`` or
    :meth:`from_vectorstore`. A hit of a user's retriever becomes a module of ``collection``,
    named by its id (else by its text); one the engine has not encoded yet (or whose text changed
    under its id) is encoded ``encode="background"`` after the request (the default: a first
    request is never slower than full prefill, the next reuses it), ``"eager"`` before returning,
    or ``"off"`` never, and read as text until then.

    Returned documents carry ``metadata["module"]``, ``"schema"`` and, for every document the
    engine holds, ``"reference"`` (a genuine module reference: what :func:`format_modules` puts
    into the prompt); pc-rag's index adds ``"score"``. ``collections`` limits what a request may
    read (per call: ``config={"configurable": {"collections": [...]}}``, which narrows it, never
    widens it).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: Any = Field(default=None, exclude=True)
    """A :class:`~pc_rag.retrievers.FaissModuleRetriever` or any LangChain ``BaseRetriever``;
    by default pc-rag's index over the shared default engine's documents."""
    engine: Any = Field(default=None, exclude=True)
    """The :class:`~pc_rag.PromptCache` whose store holds the modules: the FAISS index's own
    engine, else the shared default engine."""
    k: int = Field(default=4, ge=1)
    """pc-rag's index: how many documents to return (``search_kwargs["k"]`` and a per-call ``k`` win)."""
    search_kwargs: dict[str, Any] = Field(default_factory=dict)
    """pc-rag's index: ``k`` and ``filter`` (a dict of metadata conditions: ``{"source": "a"}``,
    ``{"year": {"$gte": 2020}}``, ``$in``/``$nin``/``$ne``/``$lt``..., ``$and``/``$or``; or a
    callable over the metadata). A user's retriever keeps its own search settings."""
    collections: list[str] | None = None
    """The collections this retriever's requests may read (None: all of them)."""
    collection: str | None = None
    """A user's retriever: the collection its hits become modules of (default: the request's only
    collection, else ``"docs"``)."""
    encode: Literal["background", "eager", "off"] = "background"
    """A user's retriever: when hits the engine has not encoded are encoded (see the class docstring)."""
    reorder: bool = False
    """Place each returned document after the neighbour it was encoded behind where the ranking
    allows (documents added with ``context="neighbours"``; :func:`pc_rag.prompt.neighbours.reorder`),
    as LangChain's ``LongContextReorder`` reorders: more of the prompt reads as full prefill."""

    def model_post_init(self, context: Any) -> None:
        if self.engine is not None and not isinstance(self.engine, PromptCache):
            raise PromptCacheError(f"engine must be a pc_rag.PromptCache, got {type(self.engine).__name__}")
        if self.retriever is None:
            self.retriever = FaissModuleRetriever.from_engine(self.engine or shared_engine())
        if isinstance(self.retriever, FaissModuleRetriever):
            if self.engine is not None and self.retriever.engine is not None and self.retriever.engine is not self.engine:
                raise PromptCacheError("engine= is not the engine the FaissModuleRetriever is bound to")
            self.engine = self.engine or self.retriever.engine
            unknown = set(self.search_kwargs) - {"k", "filter"}
            if unknown:
                raise PromptCacheError(f"unknown search_kwargs: {', '.join(sorted(unknown))} (known: k, filter)")
        elif isinstance(self.retriever, BaseRetriever):
            if self.search_kwargs or "k" in self.model_fields_set:
                raise PromptCacheError("k and search_kwargs apply to pc-rag's own index; set them on your retriever "
                                       "(e.g. vectorstore.as_retriever(search_kwargs={'k': 4}))")
            self.engine = self.engine or shared_engine()
        else:
            raise PromptCacheError(f"retriever must be a LangChain BaseRetriever or a pc_rag.retrievers.FaissModuleRetriever, "
                                   f"got {type(self.retriever).__name__}")
        check_encode(self.encode)

    @classmethod
    def from_vectorstore(cls, vectorstore: VectorStore, *, engine: PromptCache | None = None, collection: str | None = None,
                         collections: list[str] | None = None, encode: Literal["background", "eager", "off"] = "background",
                         **search_kwargs: Any) -> "PromptCacheRetriever":
        """Over any LangChain ``VectorStore`` (Chroma, FAISS, Qdrant, pgvector, ...): ``search_kwargs``
        go to ``vectorstore.as_retriever`` as you would write them there (``search_type="mmr"``,
        ``search_kwargs={"k": 4, "filter": {...}}``); ``k``, ``filter`` and ``fetch_k`` given
        directly are put into its ``search_kwargs``."""
        if not isinstance(vectorstore, VectorStore):
            raise PromptCacheError(f"from_vectorstore takes a LangChain VectorStore, got {type(vectorstore).__name__}")
        inner = dict(search_kwargs.pop("search_kwargs", None) or {})
        for key in ("k", "filter", "fetch_k", "lambda_mult", "score_threshold"):
            if key in search_kwargs:
                inner[key] = search_kwargs.pop(key)
        retriever = vectorstore.as_retriever(search_kwargs=inner, **search_kwargs)
        return cls(retriever=retriever, engine=engine, collection=collection, collections=collections, encode=encode)

    def invoke(self, input: str, config: Any = None, **kwargs: Any) -> list[Document]:  # noqa: A002 - LangChain's name
        return super().invoke(input, config, **_scoped(config, kwargs))

    async def ainvoke(self, input: str, config: Any = None, **kwargs: Any) -> list[Document]:  # noqa: A002
        return await super().ainvoke(input, config, **_scoped(config, kwargs))

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        allowed = narrow(self.collections, kwargs.pop("collections", None))
        if isinstance(self.retriever, FaissModuleRetriever):
            return self._ordered(self._search_index(query, allowed, kwargs))
        collection = target_collection(self.collection, allowed)
        found = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        return self._ordered(self._as_modules(found, collection))

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        allowed = narrow(self.collections, kwargs.pop("collections", None))
        if isinstance(self.retriever, FaissModuleRetriever):
            return self._ordered(await asyncio.to_thread(self._search_index, query, allowed, kwargs))
        collection = target_collection(self.collection, allowed)
        found = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        return self._ordered(await asyncio.to_thread(self._as_modules, found, collection))

    def _ordered(self, docs: list[Document]) -> list[Document]:
        """``docs`` as returned, or (``reorder=True``) each after the neighbour it was encoded behind."""
        if not self.reorder:
            return docs
        return reordered(self.engine, docs, lambda d: (d.metadata["schema"], d.metadata["module"]) if "reference" in d.metadata else None)

    def _as_modules(self, found: list[Document], collection: str) -> list[Document]:
        """A user's retriever's documents, named as modules of ``collection`` (see :func:`as_modules`)."""
        modules = as_modules(self.engine, collection, [(d.id, d.page_content, d.metadata) for d in found], self.encode)
        out = []
        for doc, (name, reference) in zip(found, modules):
            # "reference" is ours alone: one in a vector store's metadata was written by someone else
            metadata = {key: value for key, value in (doc.metadata or {}).items() if key != "reference"}
            metadata.update(module=name, schema=collection)
            if reference is not None:
                metadata["reference"] = reference
            out.append(Document(page_content=doc.page_content, metadata=metadata, id=doc.id))
        return out

    def _search_index(self, query: str, allowed: list[str] | None, kwargs: dict[str, Any]) -> list[Document]:
        unknown = set(kwargs) - {"k", "filter"}
        if unknown:
            raise PromptCacheError(f"unknown retriever arguments: {', '.join(sorted(unknown))} (known: k, filter, collections)")
        search = {"k": self.k, **self.search_kwargs, **kwargs}
        hits = self.retriever.search(query, k=search["k"], filter=search.get("filter"), collections=allowed)
        return [
            Document(
                page_content=hit.text,
                metadata={**hit.metadata, "module": hit.module, "schema": hit.schema, "score": hit.score,
                          "reference": module_reference(hit.module, hit.schema)},
                id=document_id(hit.module),
            )
            for hit in hits
        ]


def format_modules(docs: Sequence[Document]) -> str:
    """The retrieved documents as module references, one paragraph each, for a prompt template.

    Only a genuine reference becomes an import: ``metadata["reference"]`` as
    :class:`PromptCacheRetriever` sets it (a tag made with this process's secret for exactly
    that collection and module). Metadata is written by whoever wrote the documents (a vector
    store, another retriever, a user), so a ``metadata["module"]`` or ``"schema"`` alone names
    nothing: such documents, and those from other retrievers, are written as their text, which
    the engine still reuses if it holds that text verbatim (drop-in) in a collection the request
    may read.
    """
    parts = []
    for doc in docs:
        reference = (doc.metadata or {}).get("reference")
        parts.append(reference if is_reference(reference) else doc.page_content)
    return "\n\n".join(parts)
