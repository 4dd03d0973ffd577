"""pc-rag: Prompt Cache (modular attention reuse) for retrieval-augmented generation.

Reusable text is declared as prompt modules in a PML schema; their attention key/value states
are computed once and reused by every prompt that imports them.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .decode.logprobs import TokenLogprob
    from .decode.request import CacheStats, Generation
    from .engine import DEFAULT_ENCODING, PromptCache
    from .errors import ContextWindowExceeded, PromptCacheError, QueueFull, ServingFailed, UnknownModule
    from .prompt.documents import DocumentRecord, build_prompt, module_reference
    from .prompt.plan import Plan, Segment
    from .prompt.pml import PML, escape, parse_prompt, parse_schema
    from .registry_snapshot import Schema

# imported on first use (PEP 562): `pc-rag --help` and light tools do not pay for torch
_WHERE = {
    "DEFAULT_ENCODING": "engine", "PromptCache": "engine", "Schema": "registry_snapshot", "DocumentRecord": "prompt.documents",
    "build_prompt": "prompt.documents", "module_reference": "prompt.documents", "PromptCacheError": "errors", "QueueFull": "errors",
    "ServingFailed": "errors", "ContextWindowExceeded": "errors", "UnknownModule": "errors",
    "CacheStats": "decode.request", "Generation": "decode.request", "TokenLogprob": "decode.logprobs", "Plan": "prompt.plan", "Segment": "prompt.plan",
    "PML": "prompt.pml", "escape": "prompt.pml", "parse_prompt": "prompt.pml", "parse_schema": "prompt.pml",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pc_rag' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "DEFAULT_ENCODING",
    "CacheStats",
    "ContextWindowExceeded",
    "DocumentRecord",
    "Generation",
    "PML",
    "Plan",
    "PromptCache",
    "PromptCacheError",
    "QueueFull",
    "Schema",
    "Segment",
    "ServingFailed",
    "TokenLogprob",
    "UnknownModule",
    "build_prompt",
    "escape",
    "module_reference",
    "parse_prompt",
    "parse_schema",
]
__version__ = "0.1.0"
