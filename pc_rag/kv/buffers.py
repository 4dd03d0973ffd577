"""Key/value tensors: one module's stored KV, and the preallocated per-request cache.

``ModuleKV`` keeps all layers of one module in one contiguous tensor
``[layers, 2 (keys, values), kv_heads, tokens, head_dim]``: one allocation to move between
tiers, one safetensors entry on disk, and slices of it copy into a request's cache for all
layers in a single ``copy_``.

``KVBuffer`` is a request's cache, allocated once at its final size (prompt + max new tokens).
transformers' ``DynamicCache`` concatenates on every update, which copies the whole cache at
prefill and again at every decoded token; the buffer's layers write new keys and values in place
and hand the model views of the filled part. For decoding, :meth:`KVBuffer.fix` turns the views into
fixed-length ones written at a column held on the device, so that every step has the same shapes
(what torch.compile and a CUDA graph need); the attention mask then hides what is not written yet.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .. import forks
from ..errors import PromptCacheError
from .shape import kv_shape

# a batch's cache capacity is rounded up to a multiple of this many entries: a compiled decode
# step sees a few shapes, not one per prompt length
BATCH_GRANULARITY = 256


def batch_capacity(entries: int) -> int:
    """``entries`` rounded up to the batch granularity."""
    return -(-entries // BATCH_GRANULARITY) * BATCH_GRANULARITY


@dataclass
class ModuleKV:
    """The attention states of one module, encoded at ``positions``."""

    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]
    positions: torch.Tensor  # [tokens] int64, the positions the keys were encoded at

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[1] != 2 or self.kv.shape[3] != self.positions.numel():
            raise PromptCacheError(f"malformed module KV: kv {tuple(self.kv.shape)}, positions {tuple(self.positions.shape)}")

    def __len__(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.positions.numel() * 8

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None, *, pin: bool = False) -> "ModuleKV":
        kv = self.kv.to(device=device, dtype=dtype or self.kv.dtype)
        if pin and kv.device.type == "cpu":
            kv = kv.pin_memory()
        return ModuleKV(kv, self.positions.to("cpu"))

    def read(self, start: int = 0, end: int | None = None, *, dtype: torch.dtype | None = None,
             device: torch.device | str | None = None) -> torch.Tensor:
        """Tokens ``[start, end)`` as ``[layers, 2, kv_heads, n, head_dim]``: a view where ``dtype``
        and ``device`` are the stored ones (what :class:`pc_rag.kv.quantize.QuantizedModuleKV`
        dequantizes, this one hands out as it is)."""
        kv = self.kv[:, :, :, start:end]
        return kv.to(device=device if device is not None else kv.device, dtype=dtype or kv.dtype)


def _check_capacity(end: int, capacity: int) -> None:
    if end > capacity:
        raise PromptCacheError(f"KV buffer overflow: {end} tokens > capacity {capacity}")


def read_at(key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` in ``dtype``, the queries': KV held in 16 bits under a wider model
    (``PromptCache(kv_dtype=)``) is attended at the model's dtype, widened exactly; KV already in it
    comes back as it is, not copied. Every tensor-op attention over pc-rag's buffers reads through here."""
    if key.dtype == dtype and value.dtype == dtype:
        return key, value
    return key.to(dtype), value.to(dtype)


class _BufferLayer(DynamicLayer):
    """One layer's view of a :class:`KVBuffer`: ``update`` writes in place, never concatenates."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        # no reference back to the KVBuffer: a cycle would keep the buffer's storage alive
        # until Python's cyclic collector happens to run (it counts objects, not bytes), and
        # a process encoding many documents held hundreds of MB of dead buffers that way
        self._keys_all, self._values_all = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.keys, self.values = keys[..., :0, :], values[..., :0, :]
        self.column: torch.Tensor | None = None  # fixed shapes: where the next token's KV goes, [1] on the device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # storage exists from the start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.column is not None:  # a decode step: written in place, the views keep their length
            dtype = self._keys_all.dtype  # index_copy_ takes no other (16-bit buffers under a float32 model)
            self._keys_all.index_copy_(2, self.column, key_states.to(dtype))
            self._values_all.index_copy_(2, self.column, value_states.to(dtype))
            return self.keys, self.values
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        _check_capacity(end, self._keys_all.shape[-2])
        self._keys_all[..., start:end, :].copy_(key_states)
        self._values_all[..., start:end, :].copy_(value_states)
        self.keys = self._keys_all[..., :end, :]
        self.values = self._values_all[..., :end, :]
        return self.keys, self.values

    def step_storage(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
        """For a decode step that writes its new key and value itself (:mod:`pc_rag.forward.fused_step`):
        this layer's key and value storage ``[batch, kv_heads, capacity, dim]`` and the entry the
        new token goes to (under fixed shapes the cursor's ``[1]`` tensor, which every layer shares:
        the caller reads it once, not once a layer); the views then cover that entry, as
        :meth:`update` leaves them."""
        if self.column is not None:
            return self._keys_all, self._values_all, self.column
        end = self.keys.shape[-2]
        _check_capacity(end + 1, self._keys_all.shape[-2])
        self.grow_to(end + 1)
        return self._keys_all, self._values_all, end

    @property
    def capacity(self) -> int:
        """Entries this layer's storage holds a row."""
        return self._keys_all.shape[-2]

    def rebase(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The same entries over other rows' storage (a widened buffer)."""
        end = self.keys.shape[-2]
        self._keys_all, self._values_all = keys, values
        self.grow_to(end, self.column)

    def grow_to(self, end: int, column: torch.Tensor | None = None) -> None:
        self.keys = self._keys_all[..., :end, :]
        self.values = self._values_all[..., :end, :]
        self.column = column

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


class KVBuffer:
    """A request's KV cache of fixed capacity, usable as ``past_key_values``."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, capacity: int, *, dtype: torch.dtype, device: torch.device, batch: int = 1,
        reserve: int = 0,
    ) -> None:
        self.capacity = capacity
        self.batch = batch
        # [layers, 2, rows, kv_heads, capacity, head_dim]: layer views are [batch, heads, capacity, dim]
        # over the first ``batch`` rows; ``reserve`` more rows are allocated for :meth:`widen` (never
        # touched until then: the OS gives them pages only when a row is written)
        self._all = torch.empty(layers, 2, batch + reserve, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.storage = self._all[:, :, :batch]
        self._layers = [_BufferLayer(self._all[i, 0, :batch], self._all[i, 1, :batch]) for i in range(layers)]
        self.cache = Cache(layers=self._layers)

    @property
    def reserved(self) -> int:
        """Rows allocated beyond ``batch`` (what :meth:`widen` can take)."""
        return self._all.shape[2] - self.batch

    def widen(self, batch: int) -> None:
        """Use the first ``batch`` rows (more than now, within the reserve): the layers' views
        keep their length and write column; the new rows' entries are the caller's to write."""
        if not self.batch <= batch <= self._all.shape[2]:
            raise PromptCacheError(f"cannot widen a KV buffer of {self.batch} rows (+{self.reserved} reserved) to {batch}")
        self.batch = batch
        self.storage = self._all[:, :, :batch]
        for i, layer in enumerate(self._layers):
            layer.rebase(self._all[i, 0, :batch], self._all[i, 1, :batch])

    @classmethod
    def for_model(cls, model: Any, capacity: int, batch: int = 1, *, dtype: torch.dtype | None = None) -> "KVBuffer":
        """A buffer for ``model``'s layers, in ``dtype`` (default: the model's)."""
        layers, kv_heads, head_dim = kv_shape(model)
        return cls(layers, kv_heads, head_dim, capacity, dtype=dtype or model.dtype, device=model.device, batch=batch)

    def __len__(self) -> int:
        return self._layers[0].get_seq_length()

    @property
    def spans_storage(self) -> bool:
        """Whether the layers' views cover every allocated row and entry (no reserve, filled or
        fixed to capacity). A compiled step needs it: its inputs are views of one tensor, and
        the compiled code checks that tensor's shape, which its guards do not (a buffer with the
        same views over more rows failed the step's size assertion instead of recompiling)."""
        return self.reserved == 0 and len(self) == self.capacity

    @property
    def fixed(self) -> bool:
        """Whether the layers hand out fixed-length views (see :meth:`fix`)."""
        return self._layers[0].column is not None

    def reset(self) -> None:
        """Empty the buffer, keeping its storage (already faulted-in memory) for the next request."""
        self.grow_to(0)

    def grow_to(self, end: int) -> None:
        """Declare the first ``end`` entries filled (written directly into ``storage``)."""
        self.check_capacity(end)
        for layer in self._layers:
            layer.grow_to(end)

    def fix(self, end: int, column: torch.Tensor) -> None:
        """Fixed shapes for decoding: every layer hands the model its first ``end`` entries, and a
        new token's KV is written at ``column`` (``[1]`` long, on the device, advanced by the caller).
        Entries not written yet are zeroed: masked keys still meet their values in a product, and
        0 x NaN (uninitialised memory) is NaN. Undone by :meth:`grow_to`/:meth:`reset`."""
        self.check_capacity(end)
        start = len(self)
        self.storage[:, :, :, :, start:end].zero_()
        for layer in self._layers:
            layer.grow_to(end, column)

    def check_capacity(self, end: int) -> None:
        _check_capacity(end, self.capacity)

    def mark_static(self) -> None:
        """Tell torch.compile that the tensors a decode step reads and writes in place keep their
        addresses (a CUDA graph reads them where they are instead of copying them in and out on
        every replay). Unguarded: another buffer of the same shape is not a recompilation. The
        layers' views are remade together (:meth:`fix`, :meth:`grow_to`, :meth:`widen`), so one
        look at the first layer's tells whether they are marked already (a step costs no loop)."""
        if getattr(self._layers[0].keys, "_dynamo_static_input_type", None) is not None:
            return
        for tensor in self._step_tensors():
            torch._dynamo.mark_static_address(tensor, guard=False)

    def mark_dynamic_capacity(self) -> None:
        """Tell torch.compile that the number of entries a decode step reads is not fixed: the
        first compilation takes it symbolic, so a buffer of another capacity runs the same graph
        instead of compiling a second one on some caller's request (a hint: where torch
        specializes the size anyway, no error). The views' base too: the compiled code asserts the
        base's shape, which the guards do not check, and a freshly compiled graph took the base's
        capacity as fixed (a lone row at 1024 entries, then one at 256, failed the step instead
        of running it). Checked on the first layer as :meth:`mark_static` is."""
        if getattr(self._layers[0].keys, "_dynamo_weak_dynamic_indices", None):
            return
        for tensor in self._step_tensors():
            torch._dynamo.maybe_mark_dynamic(tensor, 2)
        torch._dynamo.maybe_mark_dynamic(self._all, 4)

    def _step_tensors(self) -> Iterator[torch.Tensor]:
        """What a compiled decode step reads of each layer: its storage and its views."""
        for layer in self._layers:
            yield from (layer._keys_all, layer._values_all, layer.keys, layer.values)

    def append(self, kv: torch.Tensor, rotate: Any = None) -> None:
        """Append stored module KV ``[layers, 2, heads, n, dim]`` after what the buffer holds.

        ``rotate(out, keys)`` writes moved keys into ``out`` (RoPE modules placed at a new
        position); without it keys and values are copied as they are, all layers in one copy.
        A batched buffer gets the same KV in every row (a shared prefix); rotated KV goes to one
        row at a time (:meth:`write`).
        """
        start = len(self)
        self.write(kv, start, rotate=rotate)
        self.grow_to(start + kv.shape[3])

    def write(self, kv: torch.Tensor, start: int, *, row: int | None = None, rotate: Any = None) -> None:
        """Write module KV at entries ``[start, start + n)`` of one row (every row when ``row`` is
        None), without changing how many entries count as filled."""
        end = start + kv.shape[3]
        self.check_capacity(end)
        if rotate is None:
            dest = self.storage[:, :, :, :, start:end, :] if row is None else self.storage[:, :, row, :, start:end, :]
            dest.copy_(kv.unsqueeze(2) if row is None else kv)
            return
        if row is None:
            if self.batch != 1:
                raise PromptCacheError("rotated writes go to one row at a time")
            row = 0
        dest = self.storage[:, :, row, :, start:end, :]
        dest[:, 1].copy_(kv[:, 1])
        keys = kv[:, 0].to(dest.device)
        if keys.dtype.itemsize > dest.dtype.itemsize:  # 16-bit buffers (kv_dtype): rotated at the keys' precision, rounded once
            rotated = torch.empty_like(keys)
            rotate(rotated, keys)
            dest[:, 0].copy_(rotated)
            return
        rotate(dest[:, 0], keys.to(dest.dtype))

    def slice(self, start: int, end: int, row: int = 0) -> torch.Tensor:
        """The stored KV of positions ``[start, end)`` of one row as ``[layers, 2, heads, n, dim]`` (a view)."""
        return self.storage[:, :, row, :, start:end, :]


class BufferPool:
    """Reuses request buffers.

    A fresh multi-megabyte allocation is served by new pages from the OS, and faulting them in
    costs more than copying the module KV itself (measured: 76 ms vs 20 ms for 4K tokens of
    SmolLM2 KV). Idle buffers are kept and handed out again: as many as were ever in use at
    once (concurrent callers each find one), at least ``keep``.
    """

    def __init__(self, model: Any, keep: int = 2, granularity: int = 1024, *, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.dtype = dtype  # the buffers' (default: the model's)
        self.keep = keep
        self.granularity = granularity
        self._idle: list[KVBuffer] = []
        self._in_use = 0
        self._peak = 0
        self._lock = threading.Lock()
        forks.renew_after_fork(self, "_lock")

    def acquire(self, capacity: int) -> KVBuffer:
        with self._lock:
            self._in_use += 1
            self._peak = max(self._peak, self._in_use)
            fitting = [b for b in self._idle if b.capacity >= capacity]
            if fitting:
                buffer = min(fitting, key=lambda b: b.capacity)
                self._idle.remove(buffer)
                buffer.reset()
                return buffer
        return KVBuffer.for_model(self.model, self.capacity_for(capacity), dtype=self.dtype)

    def capacity_for(self, entries: int) -> int:
        """The capacity of a buffer this pool allocates for ``entries``: rounded up to its granularity."""
        return -(-entries // self.granularity) * self.granularity

    def release(self, buffer: KVBuffer) -> None:
        with self._lock:
            self._in_use = max(0, self._in_use - 1)
            self._idle.append(buffer)
            if len(self._idle) > max(self.keep, self._peak):
                self._idle.remove(min(self._idle, key=lambda b: b.capacity))

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def idle_bytes(self) -> int:
        """Bytes the idle buffers hold."""
        with self._lock:
            return sum(buffer.storage.nbytes for buffer in self._idle)

    def drop_idle(self) -> None:
        """Let go of the idle buffers (a memory budget needs their room)."""
        with self._lock:
            self._idle.clear()

    @property
    def in_use(self) -> int:
        return self._in_use
