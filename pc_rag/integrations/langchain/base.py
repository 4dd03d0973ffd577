"""What the LangChain LLM and chat model share: the engine and generation fields, the
request scope read from a run's ``configurable``, and token usage."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.runnables import Runnable
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from ...engine import PromptCache
from ...errors import PromptCacheError
from .._shared import (
    engine_kwargs,
    model_name,
    narrow,
    shared_engine,
)


class EngineParams(BaseModel):
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
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """OpenAI's (ChatOpenAI's field): lowers a token's logit once it has been generated."""
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """OpenAI's: lowers a token's logit by this for each time it has been generated."""
    logit_bias: dict[int, float] | None = None
    """OpenAI's (ChatOpenAI's field): {token id: -100 to 100} added to those tokens' logits."""
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
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": dict(sorted(self.logit_bias.items())) if self.logit_bias else None,
            "use_cache": self.use_cache,
            "pml": self.pml,
            "collections": self.collections,
            "pipeline_kwargs": dict(sorted(self.pipeline_kwargs.items())),
            # a cached reply without the log-probabilities asked for would drop them
            **{name: getattr(self, name) for name in ("logprobs", "top_logprobs") if getattr(self, name, None) is not None},
        }

    @property
    def model_name(self) -> str:
        return model_name(self.engine)

    # per-call scope from LangChain's config: ``configurable["collections"]`` becomes the call's
    # ``collections=`` keyword (BaseLLM/BaseChatModel hand a config's callbacks and tags on, not
    # its configurable)
    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:  # noqa: A002 - LangChain's name
        return super().invoke(input, config, **scoped(config, kwargs))  # type: ignore[misc]

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:  # noqa: A002
        return await super().ainvoke(input, config, **scoped(config, kwargs))  # type: ignore[misc]

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> Iterator[Any]:  # noqa: A002
        yield from super().stream(input, config, **scoped(config, kwargs))  # type: ignore[misc]

    async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:  # noqa: A002
        async for chunk in super().astream(input, config, **scoped(config, kwargs)):  # type: ignore[misc]
            yield chunk

    # several scopes in one batch (each input its caller's config): one call each, made at once by
    # Runnable's own batch (threads, or tasks: the engine's scheduler batches them) through
    # invoke/ainvoke above, with its return_exceptions; one scope: the model's batched generate
    def batch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        if isinstance(config, list) and len({repr(config_scope(c)) for c in config}) > 1:
            return Runnable.batch(self, inputs, config, return_exceptions=return_exceptions, **kwargs)  # type: ignore[arg-type]
        first = config[0] if isinstance(config, list) and config else config
        return super().batch(inputs, config, return_exceptions=return_exceptions, **scoped(first, kwargs))  # type: ignore[misc]

    async def abatch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        if isinstance(config, list) and len({repr(config_scope(c)) for c in config}) > 1:
            return await Runnable.abatch(self, inputs, config, return_exceptions=return_exceptions, **kwargs)  # type: ignore[arg-type]
        first = config[0] if isinstance(config, list) and config else config
        return await super().abatch(inputs, config, return_exceptions=return_exceptions, **scoped(first, kwargs))  # type: ignore[misc]


def config_scope(config: Any) -> Any:
    """``config["configurable"]["collections"]`` (None when absent)."""
    if not isinstance(config, dict):
        return None
    return (config.get("configurable") or {}).get("collections")


def scoped(config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the config's scope narrowing its ``collections`` (see :func:`narrow`)."""
    from_config = config_scope(config)
    if from_config is None:
        return kwargs
    return {**kwargs, "collections": narrow(kwargs.get("collections"), from_config)}


def token_usage(infos: Sequence[dict[str, Any]]) -> dict[str, int]:
    """``llm_output["token_usage"]`` of an LLM call, summed over its prompts' ``generation_info``."""
    prompt = sum(i["cached_tokens"] + i["computed_tokens"] for i in infos)
    completion = sum(i["generated_tokens"] for i in infos)
    cached = sum(i["cached_tokens"] for i in infos)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "cached_tokens": cached}
