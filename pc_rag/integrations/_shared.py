"""What the LangChain and LlamaIndex adapters share: the default engine and the reuse stats."""

from __future__ import annotations

import os
import threading
from typing import Any

from ..engine import PromptCache
from ..errors import PromptCacheError
from ..generation import Generation
from ..pml import PML, is_pml_prompt

_engines: dict[str | None, PromptCache] = {}
_lock = threading.Lock()


def shared_engine(model: str | None = None) -> PromptCache:
    """One engine per model per process: adapters built without ``engine=`` share it.

    Loading a model is the expensive part, and chains often build several LLM objects.
    """
    with _lock:
        engine = _engines.get(model)
        if engine is None:
            engine = _engines[model] = PromptCache.from_pretrained(model)
        return engine


def model_name(engine: PromptCache) -> str:
    """The hub id, or the folder name of a local model (not its whole path)."""
    name = str(getattr(engine.model, "name_or_path", None) or getattr(engine.model.config, "_name_or_path", "") or "pc-rag")
    return os.path.basename(name.rstrip("/")) if os.path.isabs(name) else name


def generation_info(result: Generation, engine: PromptCache) -> dict[str, Any]:
    """Reuse statistics (``cached_tokens``, ``computed_tokens``, ``ttft_s``, ...) plus the finish reason."""
    info = result.stats.as_dict()
    info["finish_reason"] = result.finish_reason
    info["model_name"] = model_name(engine)
    return info


SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "use_cache", "seed")
_DEFAULTED = ("max_new_tokens", "temperature", "top_p", "top_k", "use_cache")  # fields every adapter has


def engine_kwargs(adapter: Any, kwargs: dict[str, Any], stop: list[str] | None, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """``generate`` arguments: per-call ``kwargs`` over the adapter's fields; unknown names are an error.

    ``max_tokens`` (the LangChain/OpenAI name) is accepted for ``max_new_tokens``.
    """
    kwargs = dict(kwargs)
    if "max_tokens" in kwargs:
        kwargs.setdefault("max_new_tokens", kwargs.pop("max_tokens"))
    unknown = set(kwargs) - set(SAMPLING_KEYS) - set(ignored)
    if unknown:
        raise PromptCacheError(f"unknown generation arguments: {', '.join(sorted(unknown))} (known: {', '.join(SAMPLING_KEYS)})")
    params = {key: kwargs.get(key, getattr(adapter, key)) for key in _DEFAULTED}
    params["stop"] = stop
    if "seed" in kwargs:
        params["seed"] = kwargs["seed"]
    return params


def as_prompt(text: str, pml: bool) -> str:
    """What an adapter hands the engine: plain text, unless the adapter was built with ``pml=True``
    and the text is a PML prompt (a chain that sends markup says so; nothing it passes becomes
    markup otherwise)."""
    return PML(text) if pml and is_pml_prompt(text) else str(text)


def usage(result: Generation) -> dict[str, int]:
    """Token counts in the OpenAI shape that LlamaIndex's ``TokenCountingHandler`` reads from ``raw["usage"]``."""
    prompt = result.stats.cached_tokens + result.stats.computed_tokens
    completion = len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "cached_tokens": result.stats.cached_tokens}
