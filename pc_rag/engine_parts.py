"""The module KV tiers of a :class:`pc_rag.PromptCache`, built from its storage options.

:func:`open_kv` names every entry (the fingerprint: model, encoding, stored dtype and packing, so
quantized and full-precision entries never mix), opens the remote tier when one is given, and
the store over it. Nothing here holds state: the engine holds what it returns.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from .errors import PromptCacheError
from .forward.attention import ATTENTION_NAME
from .kv.quantize import scheme_for
from .kv.records import KVShape
from .kv.remote import RemoteTier
from .kv.store import ModuleStore, open_store
from .model.spec import ModelSpec
from .paths import expand

# what the memory budget counts per cached token of a quantized module: that of a 256-token
# module, a typical document (shorter modules carry a little more of their key ranges per token)
TYPICAL_MODULE_TOKENS = 256


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def with_kv_dtype(spec: ModelSpec, kv_dtype: torch.dtype | str | None) -> ModelSpec:
    """``spec`` with the dtype its KV buffers hold (``PromptCache(kv_dtype=)``; None: the model's).

    A dtype other than the model's needs pc-rag's attention function, which reads the keys and
    values in the queries' dtype; any other implementation gets the dtypes it was given."""
    if kv_dtype is None:
        return spec
    chosen = KV_DTYPES.get(kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
    if chosen not in KV_DTYPES.values():
        raise PromptCacheError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or the torch dtype), got {kv_dtype!r}")
    if chosen != spec.dtype and spec.attn_implementation != ATTENTION_NAME:
        raise PromptCacheError(f"kv_dtype={kv_dtype!r} under a {spec.dtype} model needs pc-rag's attention ({ATTENTION_NAME!r}); "
                               f"this model attends with {spec.attn_implementation!r}: load it with attn_implementation='sdpa'")
    return replace(spec, kv_dtype=chosen)


@dataclass(frozen=True)
class KVTiers:
    fingerprint: str  # part of every entry's key
    kv_dir: Path | None
    remote: RemoteTier | None
    store: ModuleStore
    bytes_per_token: int  # what the memory budget counts per cached token


def open_kv(
    spec: ModelSpec,
    *,
    encoding: str,
    kv_dir: str | os.PathLike | None,
    memory_budget: int | None,
    store_dtype: torch.dtype | None,
    kv_location: Literal["device", "cpu"],
    kv_quantization: Literal["int8", "int4"] | None,
    remote_store: str | None,
    remote_key: str | bytes | Sequence[str | bytes] | None,
    remote_timeout_ms: float,
    remote_ttl_s: float | None,
    remote_collections: Sequence[str] | None,
) -> KVTiers:
    """The tiers that hold module KV for ``spec`` under these options (see :class:`pc_rag.PromptCache`)."""
    kv_dtype = store_dtype or spec.kv_dtype
    scheme = scheme_for(kv_quantization)
    packing = f"|{scheme.name}" if scheme is not None else ""
    fingerprint = hashlib.sha256(f"{spec.fingerprint}|{encoding}|{kv_dtype}{packing}".encode()).hexdigest()[:32]
    remote = RemoteTier(remote_store, fingerprint, key=remote_key, timeout_ms=remote_timeout_ms, ttl_s=remote_ttl_s,
                        announce=remote_collections is None) if remote_store else None
    folder = expand(kv_dir) if kv_dir is not None else None
    device = spec.device if kv_location == "device" else torch.device("cpu")
    store = open_store(
        fingerprint=fingerprint, kv_dir=folder, memory_budget=memory_budget, device=device, kv_dtype=kv_dtype,
        pin=device.type == "cpu" and spec.device.type == "cuda", remote=remote,
        shape=KVShape(spec.layers, spec.kv_heads, spec.head_dim, kv_dtype, scheme),
    )
    per_token = (spec.kv_bytes_per_token(kv_dtype) if scheme is None else
                 math.ceil(scheme.bytes_per_token(spec.layers, spec.kv_heads, spec.head_dim, TYPICAL_MODULE_TOKENS)))
    return KVTiers(fingerprint, folder, remote, store, per_token)
