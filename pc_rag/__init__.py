"""pc-rag: Prompt Cache (modular attention reuse) for retrieval-augmented generation.

Reusable text is declared as prompt modules in a PML schema; their attention key/value states
are computed once and reused by every prompt that imports them.
"""

from .engine import DEFAULT_ENCODING, PromptCache
from .registry import Schema
from .documents import DocumentRecord, build_prompt, module_reference
from .errors import PromptCacheError
from .generation import CacheStats, Generation
from .layout import Plan, Segment
from .pml import PML, escape, parse_prompt, parse_schema

__all__ = [
    "DEFAULT_ENCODING",
    "CacheStats",
    "DocumentRecord",
    "Generation",
    "PML",
    "Plan",
    "PromptCache",
    "PromptCacheError",
    "Schema",
    "Segment",
    "build_prompt",
    "escape",
    "module_reference",
    "parse_prompt",
    "parse_schema",
]
__version__ = "0.1.0"
