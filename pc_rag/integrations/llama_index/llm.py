"""``PromptCacheLLM``: pc-rag as a LlamaIndex ``FunctionCallingLLM`` (completion, chat, tools,
structured prediction; sync and async)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    ToolCallBlock,
)
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import LLMStructuredPredictEndEvent, LLMStructuredPredictStartEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
from llama_index.core.program.streaming_utils import process_streaming_content_incremental
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.types import PydanticProgramMode
from pydantic import Field

from ...callers import StreamingGeneration
from ...decode.logprobs import TokenLogprob, token_texts
from ...engine import PromptCache
from ...errors import PromptCacheError
from ...prompt.pml import is_pml_prompt
from ...prompt.schemas import closed
from ...prompt.tools import call_id, call_schema, parse_calls, resolve_tool_choice
from .._shared import (
    as_prompt,
    check_document,
    engine_kwargs,
    generation_info,
    iterate_in_thread,
    model_name,
    shared_engine,
    usage,
)

dispatcher = get_dispatcher(__name__)


class PromptCacheLLM(FunctionCallingLLM):
    """A LlamaIndex LLM served by Prompt Cache, with function calling and constrained structured output.

    ``PromptCacheLLM(engine=engine, max_new_tokens=128)``. ``chat`` renders messages with the
    model's chat template; ``complete`` sends the prompt as one user turn through it (or through
    ``completion_to_prompt`` when one is set; as given with ``formatted=True``). When the
    tokenizer has a chat template the LLM reports itself as a chat and function-calling model, so
    query engines send it chat messages and agents (``FunctionAgent``), ``predict_and_call`` and
    ``FunctionCallingProgram`` hand it tools: a required call (``tool_required=True``,
    ``tool_choice="required"`` or a tool's name) is decoded under its JSON schema, so it always
    parses (:mod:`pc_rag.prompt.tools`). ``structured_predict`` and ``as_structured_llm`` decode under
    the output class's JSON schema (:mod:`pc_rag.decode.constrained`). Reuse statistics are in each
    response's ``additional_kwargs``.
    """

    engine: Any = Field(default=None, exclude=True, description="the pc_rag.PromptCache")
    model: str | None = Field(default=None, description="hub id or local folder used when no engine is given")
    max_new_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = None
    use_cache: bool = Field(default=True, description="False runs full prefill of the same tokens (the baseline)")
    pml: bool = Field(default=False, description="read completion prompts that are PML (<prompt schema=...>) as markup; off, a prompt is plain text whatever it contains")
    context_window: int | None = Field(default=None, ge=1, description="overrides the model's context window in metadata (what LlamaIndex packs prompts to)")
    generate_kwargs: dict[str, Any] = Field(default_factory=dict, description="generation arguments for every call (per-call keywords win), as HuggingFaceLLM's")
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="PromptCache.from_pretrained arguments, when no engine is given")
    collections: list[str] | None = Field(default=None, description="the collections this LLM's requests may read (None: all); a per-call "
                                          "collections= keyword narrows it, never widens it")
    logprobs: bool | None = Field(default=None, description="return each generated token's log-probability in the response's "
                                  "logprobs (LlamaIndex OpenAI's field and shape)")
    top_logprobs: int = Field(default=0, ge=0, le=20, description="with logprobs: the most likely tokens at each step, listed for it")

    def __init__(self, engine: PromptCache | None = None, model: str | None = None, **kwargs: Any) -> None:
        if engine is None:
            engine = shared_engine(model, **kwargs.get("model_kwargs", {}))
        elif not isinstance(engine, PromptCache):
            raise PromptCacheError(f"engine must be a pc_rag.PromptCache, got {type(engine).__name__}")
        super().__init__(engine=engine, model=model, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self.engine.context_window or 2048,
            num_output=self.max_new_tokens,
            is_chat_model=self._has_chat_template,
            is_function_calling_model=self._has_chat_template,
            model_name=model_name(self.engine),
        )

    @property
    def _has_chat_template(self) -> bool:
        return bool(getattr(self.engine.tokenizer, "chat_template", None))

    def _engine_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = {**self.generate_kwargs, **kwargs}
        logprobs, top = kwargs.pop("logprobs", self.logprobs), kwargs.pop("top_logprobs", self.top_logprobs)
        params = engine_kwargs(self, kwargs, kwargs.pop("stop", None))
        if logprobs:
            params["logprobs"] = top
        return params

    def _logprobs(self, entries: list[TokenLogprob] | None) -> list[list[LogProb]] | None:
        """LlamaIndex OpenAI's shape: per generated token, its step's ``top_logprobs`` most likely
        tokens (with none asked for, the token itself)."""
        if entries is None:
            return None
        text = token_texts(entries, self.engine.tokenizer)

        def prob(token_id: int, logprob: float) -> LogProb:
            return LogProb(token=text[token_id], logprob=logprob, bytes=list(text[token_id].encode()))

        return [[prob(i, lp) for i, lp in e.top] or [prob(e.token_id, e.logprob)] for e in entries]

    def _prepare(self, prompt: str, formatted: bool) -> str:
        """A completion prompt: unless ``formatted``, wrapped in ``query_wrapper_prompt``, then
        through ``completion_to_prompt`` when one is set (as HuggingFaceLLM does); else, for a
        chat model, as one user turn through the chat template (``system_prompt`` as the system
        turn), as Ollama and OpenAI chat models complete; else behind ``system_prompt``. An
        instruct model given a bare question as raw text tends to end its turn at once (an empty
        completion)."""
        text = prompt
        if not formatted and not (self.pml and is_pml_prompt(text)):
            if self.query_wrapper_prompt is not None:
                text = self.query_wrapper_prompt.format(query_str=text)
            if self.completion_to_prompt not in (None, default_completion_to_prompt):
                text = self.completion_to_prompt(text)
            elif self.metadata.is_chat_model:
                text = self._chat_prompt([ChatMessage(role="user", content=text)])
            elif self.system_prompt:
                text = f"{self.system_prompt} {text}"
        return as_prompt(text, self.pml)

    def _complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponse:
        params = self._engine_kwargs(kwargs)
        result = self.engine.generate(prompt, **params)
        check_document(result, self.engine, params)
        return CompletionResponse(text=result.text, additional_kwargs=generation_info(result, self.engine), raw={"usage": usage(result)},
                                  logprobs=self._logprobs(result.logprobs))

    async def _acomplete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponse:
        """:meth:`_complete` through the engine's asyncio path: the event loop never waits on a
        forward pass, and cancelling the awaiting task frees the request's row at the scheduler's
        next step (a worker thread would decode on to the end)."""
        params = self._engine_kwargs(kwargs)
        result = await self.engine.agenerate(prompt, **params)
        check_document(result, self.engine, params)
        return CompletionResponse(text=result.text, additional_kwargs=generation_info(result, self.engine), raw={"usage": usage(result)},
                                  logprobs=self._logprobs(result.logprobs))

    def _stream_complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponseGen:
        params = self._engine_kwargs(kwargs)
        stream: StreamingGeneration = self.engine.stream(prompt, **params)

        def responses() -> CompletionResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            assert stream.result is not None
            check_document(stream.result, self.engine, params)
            yield CompletionResponse(text=text, delta="", additional_kwargs=generation_info(stream.result, self.engine),
                                     raw={"usage": usage(stream.result)}, logprobs=self._logprobs(stream.result.logprobs))

        return responses()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(self._prepare(prompt, formatted), kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(self._prepare(prompt, formatted), kwargs)

    def _chat_prompt(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()) -> str:
        """The messages through ``messages_to_prompt`` when one is set, else the model's chat
        template (``system_prompt`` first when the messages have no system turn; tool calls,
        tool results and ``tools`` rendered as :func:`pc_rag.PromptCache.render_chat` does): plain text, never PML."""
        if self.system_prompt and not any(m.role.value == "system" for m in messages):
            messages = [ChatMessage(role="system", content=self.system_prompt), *messages]
        if self.messages_to_prompt not in (None, generic_messages_to_prompt):
            if tools:
                raise PromptCacheError("tools are rendered by the chat template; this LLM has a custom messages_to_prompt")
            return str(self.messages_to_prompt(messages))
        return self.engine.render_chat([_turn(m) for m in messages], tools=list(tools) or None)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
        """The prompt, the call's other keywords and the tools in force: ``tools`` (OpenAI specs,
        as :meth:`_prepare_chat_with_tools` gives them) and ``tool_choice`` ("auto", "none",
        "required" or a tool's name: a required call is decoded under its JSON schema)."""
        kwargs = dict(kwargs)
        tools = list(kwargs.pop("tools", None) or [])
        choice = resolve_tool_choice(kwargs.pop("tool_choice", None), tools)
        if choice == "none":
            tools = []
        elif choice != "auto":
            if "json_schema" in kwargs:
                raise PromptCacheError("give a required tool call or a json_schema, not both")
            kwargs["json_schema"] = call_schema(tools, None if choice == "required" else choice)
        return self._chat_prompt(messages, tools), kwargs, tools

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, kwargs, tools = self._chat_request(messages, kwargs)
        return _as_chat(self._complete(prompt, kwargs), tools)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, kwargs, tools = self._chat_request(messages, kwargs)
        return _stream_as_chat(self._stream_complete(prompt, kwargs), tools)

    # async: the event loop never waits on a forward pass; a cancelled call frees its row
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._acomplete(self._prepare(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return iterate_in_thread(self._stream_complete(self._prepare(prompt, formatted), kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, kwargs, tools = self._chat_request(messages, kwargs)
        return _as_chat(await self._acomplete(prompt, kwargs), tools)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt, kwargs, tools = self._chat_request(messages, kwargs)
        return iterate_in_thread(_stream_as_chat(self._stream_complete(prompt, kwargs), tools))

    # -- function calling: what agents, predict_and_call and FunctionCallingProgram call ----------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``chat`` keywords for a turn with ``tools`` (LlamaIndex tools, as OpenAI specs): a call
        is required with ``tool_required`` (or ``tool_choice="required"``/a tool's name)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role="user", content=user_msg) if isinstance(user_msg, str) else user_msg)
        if tool_choice is None:
            tool_choice = "required" if tool_required else "auto"
        return {"messages": messages, "tools": [tool.metadata.to_openai_tool() for tool in tools], "tool_choice": tool_choice, **kwargs}

    def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[Any],
                                           allow_parallel_tool_calls: bool = False, **kwargs: Any) -> ChatResponse:
        """One call only, unless parallel calls are allowed (as LlamaIndex's OpenAI LLM does)."""
        if not allow_parallel_tool_calls:
            calls = [block for block in response.message.blocks if isinstance(block, ToolCallBlock)]
            if len(calls) > 1:
                response.message.blocks = [b for b in response.message.blocks if not isinstance(b, ToolCallBlock) or b is calls[0]]
                response.message.additional_kwargs["tool_calls"] = response.message.additional_kwargs.get("tool_calls", [])[:1]
        return response

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The reply's tool calls (its ``ToolCallBlock``s) as ``ToolSelection``s."""
        calls = [ToolSelection(tool_id=block.tool_call_id or call_id(), tool_name=block.tool_name,
                               tool_kwargs=block.tool_kwargs if isinstance(block.tool_kwargs, dict) else _arguments(block.tool_kwargs))
                 for block in response.message.blocks if isinstance(block, ToolCallBlock)]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got a text reply: {response.message.content!r:.120}")
        return calls

    # -- structured output: decoded under the output class's JSON schema ---------------------------
    def _structured_messages(self, prompt: BasePromptTemplate, prompt_args: dict[str, Any]) -> list[ChatMessage]:
        return self._extend_messages(prompt.format_messages(llm=self, **prompt_args))

    @dispatcher.span
    def structured_predict(self, output_cls: type[Any], prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None,
                           **prompt_args: Any) -> Any:
        """An ``output_cls`` (a pydantic model) decoded under its JSON schema (closed: no key it
        does not name), so the reply always parses; a budget too small for any document of the
        schema is a :class:`PromptCacheError`. With ``pydantic_program_mode`` other than the
        default, LlamaIndex's own program for that mode runs instead."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args))
        response = self.chat(self._structured_messages(prompt, prompt_args), **_structured_kwargs(output_cls, llm_kwargs))
        return _structured_result(output_cls, response)

    @dispatcher.span
    async def astructured_predict(self, output_cls: type[Any], prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any) -> Any:
        """:meth:`structured_predict` through :meth:`achat` (the engine's asyncio path: a cancelled
        call frees its row at the next step; on a worker thread it decoded on to the end)."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args))
        response = await self.achat(self._structured_messages(prompt, prompt_args), **_structured_kwargs(output_cls, llm_kwargs))
        return _structured_result(output_cls, response)

    @dispatcher.span
    def stream_structured_predict(self, output_cls: type[Any], prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any) -> Generator[Any, None, None]:
        """Partial objects as the constrained document grows (LlamaIndex's incremental parsing),
        the last one an ``output_cls``."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        responses = self.stream_chat(self._structured_messages(prompt, prompt_args), **_structured_kwargs(output_cls, llm_kwargs))

        def partials() -> Generator[Any, None, None]:
            current = None
            for response in responses:
                current = process_streaming_content_incremental(response, output_cls, current)
                yield current

        return partials()

    @dispatcher.span
    async def astream_structured_predict(self, output_cls: type[Any], prompt: BasePromptTemplate,
                                         llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> AsyncGenerator[Any, None]:
        """:meth:`stream_structured_predict`, decoded by a worker thread."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        return iterate_in_thread(self.stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args))


def _structured_result(output_cls: type[Any], response: ChatResponse) -> Any:
    """The reply parsed as ``output_cls`` (constrained decoding made it a document of its schema)."""
    result = output_cls.model_validate_json(response.message.content or "")
    dispatcher.event(LLMStructuredPredictEndEvent(output=result))
    return result


def _structured_kwargs(output_cls: type[Any], llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(llm_kwargs or {})
    for key in ("tools", "tool_choice", "tool_required", "allow_parallel_tool_calls"):  # what programs pass on
        kwargs.pop(key, None)
    kwargs["json_schema"] = closed(output_cls.model_json_schema())
    return kwargs


def _turn(message: ChatMessage) -> dict[str, Any]:
    """A LlamaIndex message as a chat-template turn: tool calls (``ToolCallBlock``s) and tool
    results (role "tool", ``additional_kwargs["tool_call_id"]``) included."""
    turn: dict[str, Any] = {"role": str(message.role.value), "content": message.content or ""}
    calls = [block for block in message.blocks if isinstance(block, ToolCallBlock)]
    if calls:
        turn["tool_calls"] = [{"type": "function", "id": block.tool_call_id, "function": {
            "name": block.tool_name, "arguments": block.tool_kwargs if isinstance(block.tool_kwargs, dict) else _arguments(block.tool_kwargs)}}
            for block in calls]
    if turn["role"] == "tool":
        if message.additional_kwargs.get("tool_call_id"):
            turn["tool_call_id"] = message.additional_kwargs["tool_call_id"]
        if message.additional_kwargs.get("name"):
            turn["name"] = message.additional_kwargs["name"]
    return turn


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments written as JSON text (a streamed call's, or another LLM's)."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _as_chat(response: CompletionResponse, tools: Sequence[dict[str, Any]] = ()) -> ChatResponse:
    """A completion as the assistant's message: its tool calls as ``ToolCallBlock``s (and in
    ``additional_kwargs["tool_calls"]``, OpenAI's shape) when, with tools bound, the reply is one."""
    calls = parse_calls(response.text, tools) if tools else []
    if not calls:
        message = ChatMessage(role="assistant", content=response.text)
    else:
        ids = [call_id() for _ in calls]
        message = ChatMessage(
            role="assistant",
            blocks=[ToolCallBlock(tool_call_id=i, tool_name=c["name"], tool_kwargs=c["arguments"]) for i, c in zip(ids, calls)],
            additional_kwargs={"tool_calls": [{"id": i, "type": "function", "function": {
                "name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}} for i, c in zip(ids, calls)]},
        )
    additional = dict(response.additional_kwargs)
    if calls:
        additional["finish_reason"] = "tool_calls"
    return ChatResponse(message=message, delta=response.delta, additional_kwargs=additional, raw=response.raw, logprobs=response.logprobs)


def _stream_as_chat(completions: CompletionResponseGen, tools: Sequence[dict[str, Any]]) -> ChatResponseGen:
    """Streamed completions as chat responses; with tools bound, the reply may be a call, so it
    is read whole and sent as one response."""
    if not tools:
        for response in completions:
            yield _as_chat(response)
        return
    last = None
    for last in completions:
        pass
    if last is not None:
        response = _as_chat(last, tools)
        response.delta = response.message.content or ""
        yield response
