"""LlamaIndex adapters: a ``CustomLLM`` and a retriever over a :class:`~pc_rag.PromptCache`.

The retriever's nodes render, for the LLM, as references to their pre-encoded modules (a node
``text_template``), so a query engine's synthesizer stuffs references, not text, into its
prompt; for embedding and display they are their plain text. Nodes from any other retriever
still benefit: their verbatim text is found by the engine's drop-in index.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
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
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import MetadataFilters
from pydantic import Field

from ..documents import document_id, module_reference
from ..engine import PromptCache
from ..errors import PromptCacheError
from ..generation import StreamingGeneration
from ..pml import is_pml_prompt
from ..retrievers import FaissModuleRetriever
from ._shared import (
    Encode,
    as_modules,
    as_prompt,
    check_encode,
    engine_kwargs,
    generation_info,
    iterate_in_thread,
    model_name,
    shared_engine,
    target_collection,
    usage,
)

__all__ = ["PromptCacheLLM", "PromptCacheRetriever"]


class PromptCacheLLM(CustomLLM):
    """A LlamaIndex LLM served by Prompt Cache.

    ``PromptCacheLLM(engine=engine, max_new_tokens=128)``. ``chat`` renders messages with the
    model's chat template; ``complete`` sends the prompt as one user turn through it (or through
    ``completion_to_prompt`` when one is set; as given with ``formatted=True``). When the
    tokenizer has a chat template the LLM reports itself as a chat model, so query engines send
    it chat messages. Reuse statistics are in each response's
    ``additional_kwargs``.
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
            is_chat_model=bool(getattr(self.engine.tokenizer, "chat_template", None)),
            model_name=model_name(self.engine),
        )

    def _engine_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = {**self.generate_kwargs, **kwargs}
        return engine_kwargs(self, kwargs, kwargs.pop("stop", None))

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
        result = self.engine.generate(prompt, **self._engine_kwargs(kwargs))
        return CompletionResponse(text=result.text, additional_kwargs=generation_info(result, self.engine), raw={"usage": usage(result)})

    def _stream_complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponseGen:
        stream: StreamingGeneration = self.engine.stream(prompt, **self._engine_kwargs(kwargs))

        def responses() -> CompletionResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            assert stream.result is not None
            yield CompletionResponse(text=text, delta="", additional_kwargs=generation_info(stream.result, self.engine),
                                     raw={"usage": usage(stream.result)})

        return responses()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(self._prepare(prompt, formatted), kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(self._prepare(prompt, formatted), kwargs)

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The messages through ``messages_to_prompt`` when one is set, else the model's chat
        template (``system_prompt`` first when the messages have no system turn): plain text, never PML."""
        if self.system_prompt and not any(m.role.value == "system" for m in messages):
            messages = [ChatMessage(role="system", content=self.system_prompt), *messages]
        if self.messages_to_prompt not in (None, generic_messages_to_prompt):
            return str(self.messages_to_prompt(messages))
        return self.engine.render_chat([{"role": str(m.role.value), "content": m.content or ""} for m in messages])

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _as_chat(self._complete(self._chat_prompt(messages), kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        completions = self._stream_complete(self._chat_prompt(messages), kwargs)
        return (_as_chat(response) for response in completions)

    # async: decoding runs on a worker thread, the event loop never waits on a forward pass
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, self._prepare(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return iterate_in_thread(self._stream_complete(self._prepare(prompt, formatted), kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _as_chat(await asyncio.to_thread(self._complete, self._chat_prompt(messages), kwargs))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        completions = iterate_in_thread(self._stream_complete(self._chat_prompt(messages), kwargs))

        async def responses() -> ChatResponseAsyncGen:
            async for response in completions:
                yield _as_chat(response)

        return responses()


_OPERATORS = {"==": "$eq", "!=": "$ne", ">": "$gt", ">=": "$gte", "<": "$lt", "<=": "$lte", "in": "$in", "nin": "$nin"}


def as_filter(filters: Any) -> Any:
    """LlamaIndex's ``MetadataFilters`` as the filter :meth:`FaissModuleRetriever.search` takes
    (``==``, ``!=``, ``>``, ``>=``, ``<``, ``<=``, ``in``, ``nin``; ``and``/``or``, nested);
    anything else is passed on as it is (a dict of conditions or a callable)."""
    if not isinstance(filters, MetadataFilters):
        return filters
    parts = []
    for item in filters.filters:
        if isinstance(item, MetadataFilters):
            parts.append(as_filter(item))
            continue
        op = _OPERATORS.get(getattr(item.operator, "value", item.operator))
        if op is None:
            raise PromptCacheError(f"metadata filter on {item.key!r}: operator {item.operator!r} is not supported "
                                   f"(supported: {', '.join(_OPERATORS)})")
        parts.append({item.key: {op: item.value}})
    condition = getattr(filters.condition, "value", filters.condition) or "and"
    if condition not in ("and", "or"):
        raise PromptCacheError(f"metadata filters: condition {condition!r} is not supported (and, or)")
    return {f"${condition}": parts} if parts else None


def _as_chat(response: CompletionResponse) -> ChatResponse:
    return ChatResponse(
        message=ChatMessage(role="assistant", content=response.text),
        delta=response.delta,
        additional_kwargs=response.additional_kwargs,
        raw=response.raw,
    )


class PromptCacheRetriever(BaseRetriever):
    """A LlamaIndex retriever whose nodes are pre-encoded modules, returning ``NodeWithScore``.

    Over pc-rag's own index (a :class:`~pc_rag.retrievers.FaissModuleRetriever`, the default:
    one over the shared default engine's documents), or over any LlamaIndex retriever the user
    already has: ``PromptCacheRetriever(index.as_retriever(similarity_top_k=4))`` for a
    ``VectorStoreIndex`` over any vector store. A node of a user's retriever becomes a module of
    ``collection`` named by its node id; one the engine has not encoded yet (or whose text changed
    under its id) is encoded ``encode="background"`` after the request (the default),
    ``"eager"`` before returning, or ``"off"`` never, and read as text until then.

    Nodes carry ``metadata["module"]`` and ``"schema"``; with ``references=True`` (default) the
    LLM rendering of a node the engine holds is a reference to its module, so the synthesizer's
    prompt imports the KV instead of the text. ``collections`` limits what is read; ``k`` and
    ``filter`` (LlamaIndex's ``MetadataFilters``, or the conditions of
    :func:`pc_rag.retrievers.metadata_filter`) apply to pc-rag's own index (a user's retriever
    keeps its own settings).
    """

    def __init__(self, retriever: Any = None, k: int = 4, *, engine: PromptCache | None = None, references: bool = True,
                 collections: Sequence[str] | None = None, collection: str | None = None, filter: Any = None,  # noqa: A002 - the name users know
                 encode: Encode = "background", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if engine is not None and not isinstance(engine, PromptCache):
            raise PromptCacheError(f"engine must be a pc_rag.PromptCache, got {type(engine).__name__}")
        if retriever is None:
            retriever = FaissModuleRetriever.from_engine(engine or shared_engine())
        if isinstance(retriever, FaissModuleRetriever):
            if engine is not None and retriever.engine is not None and retriever.engine is not engine:
                raise PromptCacheError("engine= is not the engine the FaissModuleRetriever is bound to")
            engine = engine or retriever.engine
        elif isinstance(retriever, BaseRetriever):
            if filter is not None or k != 4:
                raise PromptCacheError("k and filter apply to pc-rag's own index; set them on your retriever "
                                       "(e.g. index.as_retriever(similarity_top_k=4, filters=...))")
            engine = engine or shared_engine()
        else:
            raise PromptCacheError(f"retriever must be a LlamaIndex BaseRetriever or a pc_rag.retrievers.FaissModuleRetriever, "
                                   f"got {type(retriever).__name__}")
        if not isinstance(k, int) or k < 1:
            raise PromptCacheError(f"k must be a positive int, got {k!r}")
        self.retriever = retriever
        self.engine = engine
        self.k = k
        self.references = references
        self.collections = list(collections) if collections is not None else None
        self.collection = collection
        self.encode = check_encode(encode)
        # metadata conditions, as FaissModuleRetriever.search takes them, or LlamaIndex's MetadataFilters
        self.filter = as_filter(filter)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if isinstance(self.retriever, FaissModuleRetriever):
            hits = self.retriever.search(query_bundle.query_str, k=self.k, filter=self.filter, collections=self.collections)
            return [self._node(hit.text, document_id(hit.module), hit.metadata, hit.module, hit.schema, True, hit.score) for hit in hits]
        return self._as_modules(self.retriever.retrieve(query_bundle))

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if isinstance(self.retriever, FaissModuleRetriever):
            return await asyncio.to_thread(self._retrieve, query_bundle)
        found = await self.retriever.aretrieve(query_bundle)
        return await asyncio.to_thread(self._as_modules, found)

    def _as_modules(self, found: list[NodeWithScore]) -> list[NodeWithScore]:
        """A user's retriever's nodes, named as modules of the target collection (see :func:`as_modules`)."""
        collection = target_collection(self.collection, self.collections)
        hits = [(n.node.node_id, n.node.get_content(metadata_mode="none"), n.node.metadata) for n in found]
        modules = as_modules(self.engine, collection, hits, self.encode)
        return [self._node(text, node_id, metadata, name, collection, reference is not None, hit.score)
                for (node_id, text, metadata), (name, reference), hit in zip(hits, modules, found)]

    def _node(self, text: str, node_id: str, metadata: dict[str, Any], name: str, collection: str, held: bool,
              score: float | None) -> NodeWithScore:
        # "reference" is ours alone: one in a vector store's metadata was written by someone else
        metadata = {**{k: v for k, v in metadata.items() if k != "reference"}, "module": name, "schema": collection}
        reference = self.references and held
        node = TextNode(
            text=text,
            id_=node_id,
            metadata=metadata,
            # the LLM sees the reference (template below) and no metadata header; embedders see only the text
            excluded_llm_metadata_keys=[k for k in metadata if k != "module"] if reference else list(metadata),
            excluded_embed_metadata_keys=list(metadata),
        )
        if reference:
            # the template replaces the text only when the LLM rendering has metadata (``module``)
            node.text_template = module_reference(name, collection).replace("{", "{{").replace("}", "}}")
        return NodeWithScore(node=node, score=score)
