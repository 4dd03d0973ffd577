"""What a stored module entry is, in every tier that persists one (disk, Redis): its payload
(safetensors with tensors ``kv`` and ``positions``, or a quantized module's codes and ranges
(:mod:`pc_rag.kv.quantize`): no code runs on load) and its record (the
manifest: format, key, engine fingerprint, payload size, CRC-32), written and checked here, once.

An entry read back is used only when its record names this key under this engine's fingerprint
and format, the payload has the recorded size and checksum, and the tensors are what this module
is on this model (:class:`KVShape`); the tiers add what is theirs (Redis: the chunk count, the MAC).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from .buffers import ModuleKV
from .quantize import QuantizedModuleKV, Scheme, expected_shapes, from_tensors, scheme_for

# 2: keys carry their collection; every tier holds the store dtype; records may be authenticated
# 3: payloads may be quantized (kv_quantization)
FORMAT_VERSION = 3

StoredKV = ModuleKV | QuantizedModuleKV


def split_key(key: str) -> tuple[str, str]:
    """A store key's collection and digest (keys are ``<collection>/<sha-256>``; see
    :func:`pc_rag.prefill.encode.entry_key`); every tier lays its entries out by them."""
    collection, _, digest = key.rpartition("/")
    return collection or "_", digest


@dataclass(frozen=True)
class KVShape:
    """What every module KV of one engine must look like: ``[layers, 2, kv_heads, tokens,
    head_dim]`` in ``dtype``. Entries read back from disk or a shared tier are checked against
    it and against the module's own positions before use: a payload of another model, another
    module or another length (well-formed, with a good checksum) is rejected, never served."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scheme: Scheme | None = None  # kv_quantization: every entry is quantized under it

    def problem(self, module: StoredKV, positions: Sequence[int]) -> str | None:
        """Why ``module`` is not the KV of a module at ``positions`` on this model (None: it is)."""
        if isinstance(module, QuantizedModuleKV) != (self.scheme is not None) or (
                self.scheme is not None and module.scheme != self.scheme):  # type: ignore[union-attr]
            stored = module.scheme.name if isinstance(module, QuantizedModuleKV) else "full precision"
            return f"KV in {stored} where this engine stores {self.scheme.name if self.scheme else 'full precision'}"
        if isinstance(module, QuantizedModuleKV):
            tensors = module.tensors()
            for name, (shape, dtype) in expected_shapes(self.scheme, self.layers, self.kv_heads, self.head_dim,  # type: ignore[arg-type]
                                                        len(positions)).items():
                if tuple(tensors[name].shape) != shape or tensors[name].dtype != dtype:
                    return f"{name} of shape {tuple(tensors[name].shape)} in {tensors[name].dtype} where this module is {shape} in {dtype}"
        else:
            expected = (self.layers, 2, self.kv_heads, len(positions), self.head_dim)
            if tuple(module.kv.shape) != expected:
                return f"KV of shape {tuple(module.kv.shape)} where this module on this model is {expected}"
            if module.kv.dtype != self.dtype:
                return f"KV in {module.kv.dtype} where this engine stores {self.dtype}"
        if module.positions.tolist() != list(positions):
            return "positions other than this module's"
        return None


def serialize(module: StoredKV) -> bytes:
    """An entry's payload: safetensors with tensors ``kv`` and ``positions`` (a quantized module:
    its codes, ranges and positions, :meth:`~pc_rag.kv.quantize.QuantizedModuleKV.tensors`)."""
    if isinstance(module, QuantizedModuleKV):
        return save_safetensors({name: t.detach().to("cpu").contiguous() for name, t in module.tensors().items()},
                                metadata={"scheme": module.scheme.name})
    return save_safetensors({"kv": module.kv.detach().to("cpu").contiguous(), "positions": module.positions.contiguous()})


def deserialize(tensors: dict[str, torch.Tensor]) -> StoredKV:
    """A payload's tensors back as the module they were (quantized: 8 or 4 bits, read from how
    many channels a byte holds); what it must be on this engine is :meth:`KVShape.problem`'s to check."""
    if "kv" in tensors and "positions" in tensors:
        return ModuleKV(tensors["kv"], tensors["positions"].to("cpu"))
    if "keys" not in tensors or "key_scale" not in tensors or tensors["key_scale"].dim() != 4 or tensors["keys"].dim() != 4:
        raise ValueError("a payload that is neither full-precision nor quantized module KV")
    head_dim = tensors["key_scale"].shape[-1]
    bits = 8 if tensors["keys"].shape[-1] == head_dim else 4
    return from_tensors(tensors, scheme_for(f"int{bits}"), head_dim)  # type: ignore[arg-type]


def new_record(key: str, fingerprint: str, blob: bytes, **fields: Any) -> dict[str, Any]:
    """The record of payload ``blob`` stored under ``key`` (``fields``: the tier's and the caller's own)."""
    return {"format": FORMAT_VERSION, "key": key, "fingerprint": fingerprint, "bytes": len(blob),
            "crc32": zlib.crc32(blob), "created": time.time(), **fields}


def record_problem(record: Any, key: str, fingerprint: str) -> str | None:
    """Why ``record`` cannot describe ``key`` for this engine (None: it can)."""
    if not isinstance(record, dict):
        return "the record is not a JSON object"
    if record.get("format") != FORMAT_VERSION:
        return f"format {record.get('format')!r}"
    if record.get("key") != key or record.get("fingerprint") != fingerprint:
        return "written for another model, tokenizer, dtype or encoding"
    if not isinstance(record.get("bytes"), int) or record["bytes"] < 0 or not isinstance(record.get("crc32"), int):
        return "a record with a malformed size or checksum"
    return None


def payload_problem(record: dict[str, Any], size: int, crc32: Callable[[], int]) -> str | None:
    """Why a payload of ``size`` bytes is not the one ``record`` describes (None: it is);
    ``crc32()`` is computed only when the size matches."""
    if size != record["bytes"]:
        return f"truncated ({size} of {record['bytes']} bytes)"
    if crc32() != record["crc32"]:
        return "checksum mismatch"
    return None
