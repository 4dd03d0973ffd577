"""What the LangChain and LlamaIndex adapters share: the default engine and the reuse stats."""

from __future__ import annotations

import os
import threading
from typing import Any

from ..engine import PromptCache
from ..generation import Generation

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
