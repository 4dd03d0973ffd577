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
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, BaseLLM
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, Generation, GenerationChunk, LLMResult
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables.config import ensure_config
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr

from ..documents import module_reference
from ..engine import PromptCache
from ..errors import PromptCacheError
from ..generation import Generation as EngineGeneration
from ..generation import StreamingGeneration
from ..retrievers import FaissModuleRetriever
from ._shared import as_prompt, engine_kwargs, generation_info, iterate_in_thread, model_name, shared_engine

__all__ = ["ChatPromptCache", "PromptCacheLLM", "PromptCacheRetriever", "format_modules"]


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
            "pipeline_kwargs": dict(sorted(self.pipeline_kwargs.items())),
        }

    @property
    def model_name(self) -> str:
        return model_name(self.engine)


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
        else:
            # several prompts (LLM.batch / generate) decode together: one forward pass per step for all
            texts = [as_prompt(p, self.pml) for p in prompts]
            results = self.engine.generate_batch(texts, **self._engine_kwargs(stop, kwargs))
            generations = [[Generation(text=r.text, generation_info=generation_info(r, self.engine))] for r in results]
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
        """:meth:`_generate` on a worker thread: the event loop never waits on a forward pass."""
        if self.streaming:
            generations: list[list[Generation]] = []
            for prompt in prompts:
                chunks = [chunk async for chunk in self._astream(prompt, stop, run_manager, **kwargs)]
                generations.append([Generation(text="".join(c.text for c in chunks), generation_info=chunks[-1].generation_info)])
            usage = _token_usage([g[0].generation_info or {} for g in generations])
            return LLMResult(generations=generations, llm_output={"model_name": self.model_name, "token_usage": usage})
        return await asyncio.to_thread(self._generate, prompts, stop, None, **kwargs)

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

    def _prompt(self, messages: list[BaseMessage]) -> str:
        return self.engine.render_chat([{"role": _role(m), "content": m.text} for m in messages])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            return _chat_result(list(self._stream(messages, stop, run_manager, **kwargs)))
        prompt = self._prompt(messages)
        result = _batched(self, prompt) or self.engine.generate(prompt, **self._engine_kwargs(stop, kwargs))
        info = generation_info(result, self.engine)
        message = AIMessage(content=result.text, response_metadata=info, usage_metadata=_usage(result))
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        stream: StreamingGeneration = self.engine.stream(self._prompt(messages), **self._engine_kwargs(stop, kwargs))
        for text in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
            if run_manager is not None:
                run_manager.on_llm_new_token(text, chunk=chunk)
            yield chunk
        assert stream.result is not None
        info = generation_info(stream.result, self.engine)
        usage = _usage(stream.result)
        yield ChatGenerationChunk(message=AIMessageChunk(content="", response_metadata=info, usage_metadata=usage, chunk_position="last"))

    def batch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Several conversations decoded together (``engine.generate_batch``: one forward pass per
        step for all), as :class:`PromptCacheLLM` batches prompts. Callbacks, tracing and
        LangChain's response cache see one run per conversation, as with ``invoke``."""
        if self.streaming or return_exceptions or len(inputs) < 2 or isinstance(config, list):
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        config = ensure_config(config)
        conversations = [self._convert_input(item).to_messages() for item in inputs]
        stop = kwargs.pop("stop", None)
        prompts = [self._prompt(messages) for messages in conversations]
        _pending.batch = _Batch(self, prompts, self._engine_kwargs(stop, dict(kwargs)))
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
        """:meth:`_generate` on a worker thread: the event loop never waits on a forward pass."""
        if self.streaming:
            chunks = [chunk async for chunk in self._astream(messages, stop, run_manager, **kwargs)]
            return _chat_result(chunks)
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

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
    final = AIMessage(content=message.content, response_metadata=message.response_metadata, usage_metadata=message.usage_metadata)
    return ChatResult(generations=[ChatGeneration(message=final, generation_info=dict(message.response_metadata))])


class PromptCacheRetriever(BaseRetriever):
    """A LangChain retriever over a :class:`~pc_rag.retrievers.FaissModuleRetriever`.

    Returned documents carry ``metadata["module"]`` (and ``"schema"``, ``"score"``): what
    :func:`format_modules` turns into module references.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: Any = Field(default=None, exclude=True)
    """The FAISS module retriever; by default one over the shared default engine's documents."""
    k: int = Field(default=4, ge=1)

    def model_post_init(self, context: Any) -> None:
        if self.retriever is None:
            self.retriever = FaissModuleRetriever.from_engine(shared_engine())
        elif not isinstance(self.retriever, FaissModuleRetriever):
            raise PromptCacheError(f"retriever must be a pc_rag.retrievers.FaissModuleRetriever, got {type(self.retriever).__name__}")

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None, **kwargs: Any
    ) -> list[Document]:
        if kwargs:
            raise PromptCacheError(f"unknown retriever arguments: {', '.join(sorted(kwargs))} (known: k)")
        hits = self.retriever.search(query, k=k if k is not None else self.k)
        return [
            Document(
                page_content=hit.text,
                metadata={**hit.metadata, "module": hit.module, "schema": hit.schema, "score": hit.score},
                id=hit.module,
            )
            for hit in hits
        ]


def format_modules(docs: Sequence[Document]) -> str:
    """The retrieved documents as module references, one paragraph each, for a prompt template.

    Documents without ``metadata["module"]`` (from another retriever) are written as their
    text; the engine still reuses it if it holds that text verbatim.
    """
    parts = []
    for doc in docs:
        name = doc.metadata.get("module") if doc.metadata else None
        parts.append(module_reference(name, doc.metadata.get("schema", "docs")) if name else doc.page_content)
    return "\n\n".join(parts)
