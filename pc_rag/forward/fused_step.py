"""A decode step of every family :mod:`pc_rag.forward.llama_step` writes out, in one C call (``llama_step.c``), for a
model whose linear layers are pc-rag's blocks (``weights="int4"`` where :mod:`pc_rag.kernels.loader` loads). Each
layer is described to the C step by data (``kernels/step.py``'s ``Layer``: which norms and where, query/key norms,
residual scale, its RoPE table and mask), the step by its norm offset and MLP activation (docs/architecture.md).

:class:`~pc_rag.forward.llama_step.LlamaDecodeStep` runs a step as tensor ops: on the embedded
SmolLM2-135M (2-core CPU, one thread, 1,265 cached entries) 37 ms, of which 18 in the products,
10 in SDPA and ~9 in ~30 small ops a layer and the kernels' Python calls
(``benchmarks/decode_step.py``). The C step runs the same computation: RMSNorm, the products
through the same block kernels, rotate-half RoPE, the new key and value written into the
:class:`~pc_rag.kv.buffers.KVBuffer`, softmax attention of each key head's query heads over its
entries, SiLU-gated MLP and residuals, in one call for all layers; the final norm's output goes to
the model's own LM head.

It serves the steps the tensor ops serve: rows of one new token each, over a ``KVBuffer`` cache in
float32 or 16 bits (``PromptCache(kv_dtype=)``: read widened to float32, new entries rounded as torch
rounds them) whose batch is the rows, under a boolean or additive mask or none, attending by extents or
not, and over module KV read where it is stored (:mod:`pc_rag.forward.shared_attention`'s parts:
RelayAttention's two-part softmax, each part's keys read once a step for every row that reads it,
its queries rotated back by the part's move, APE's temperature and scale per part). Anything else
returns None and the tensor ops run; why is logged once (:meth:`FusedStep.refused`). :func:`~pc_rag.forward.llama_step.written_step` proves the step on the model itself
before it is used, this path included: the step it proves calls it.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PromptCacheError
from ..kernels.loader import library
from ..kernels.products import checked, weight_shapes
from ..kernels.step import LINEARS, NORMS, SCALARS, Layer, Product, Shared, Step
from ..weights import blocks
from ..weights.blocks import BlockLinear
from .rope_table import RopeTable
from .rotation import signed_sin
from .row_extents import RowExtents
from .shared_attention import SharedKV, SharedStep, row_list

logger = logging.getLogger(__name__)

MAX_SHARED = 4096  # parts one step reads (llama_step.c's MAX_SHARED)
# the KV the step reads and writes, as llama_step.c's kv_kind names it (16 bits: PromptCache(kv_dtype=))
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ACTIVATION_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}  # the MLP activations llama_step.c computes, by the config's name


@dataclass(frozen=True)
class Rows:
    """Output features ``[start, stop)`` of a linear layer that computes several (Phi-3's ``qkv_proj`` and
    ``gate_up_proj``): the C step reads them in place, as a product of its own."""

    linear: Any
    start: int
    stop: int

    @property
    def out_features(self) -> int:
        return self.stop - self.start

    @property
    def in_features(self) -> int:
        return int(self.linear.in_features)


def module_of(linear: Any) -> Any:
    """The module that computes ``linear``'s features (itself, or the layer :class:`Rows` are part of)."""
    return linear.linear if isinstance(linear, Rows) else linear


def _pointer(tensor: torch.Tensor | None, offset: int = 0) -> int | None:
    """``tensor``'s address ``offset`` rows in (None for None)."""
    return None if tensor is None else tensor.data_ptr() + offset * tensor.stride(0) * tensor.element_size()


def _product(linear: BlockLinear | Rows, shape: tuple[int, int]) -> Product:
    """``linear`` as the C step reads it, its tensors checked against each other and against ``shape``
    (out, in), the widths the step's buffers have for it; :class:`Rows`: their rows of the layer's."""
    module, start = module_of(linear), linear.start if isinstance(linear, Rows) else 0
    held = weight_shapes(module.values, module.scales, module.minimums, module.bias)
    if (linear.out_features, held[1]) != shape or not 0 <= start < start + shape[0] <= held[0]:
        raise PromptCacheError(f"a layer in blocks holds a {tuple(module.scales.shape)} weight, not the {shape[0]} x {shape[1]} "
                               "the decode step computes with", param="weights")
    return Product(_pointer(module.values, start), _pointer(module.scales, start), _pointer(module.minimums, start),
                   _pointer(module.bias, start), shape[0], shape[1], module.bits)


def unfused(step: Any) -> str | None:
    """Why ``step`` (a :class:`~pc_rag.forward.llama_step.LlamaDecodeStep`) cannot run in C (None: it can)."""
    if library() is None:
        return "pc-rag's kernels are not built"
    if any(type(module_of(getattr(layer, name))) is not BlockLinear for layer in step.layers for name in LINEARS):
        return "its linear layers are not all in blocks"
    first = step.layers[0]
    head_dim = first.q.out_features // step.heads
    if step.heads % step.kv_heads or head_dim % 8 or head_dim > 512 or first.o.in_features != step.heads * head_dim:
        return f"{step.heads} heads over {step.kv_heads} key heads of {head_dim}: not whole groups of a multiple of 8 up to 512"
    tensors = [step.norm.weight, *(getattr(layer, name) for layer in step.layers for name in NORMS)]
    if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()) for t in tensors):
        return "its norms are not contiguous float32 on a CPU"
    return None


class FusedStep:
    """``(ids, positions, mask, cache, extents) -> logits [rows, vocab]`` for a
    :class:`~pc_rag.forward.llama_step.LlamaDecodeStep` ``step``, or None where the step is not
    one it serves (see the module docstring)."""

    def __init__(self, step: Any) -> None:
        self.step = step
        self.lib = library()
        first = step.layers[0]
        self.hidden, self.head_dim = first.q.in_features, first.q.out_features // step.heads
        self.intermediate = first.gate.out_features
        # the LM head too where it is in blocks (then the step returns logits; else the model's head runs)
        self.head_in_c = type(step.head) is BlockLinear and step.head.in_features == self.hidden
        linears = [module_of(getattr(layer, name)) for layer in step.layers for name in LINEARS] + [step.head] * self.head_in_c
        self.linears = list({id(linear): linear for linear in linears}.values())  # each module once (joined ones hold several)
        # the layers' hook tables (torch adds to them in place): any hook means a step the C code would skip
        self.hooks = [table for linear in self.linears for table in (linear._forward_hooks, linear._forward_pre_hooks)]
        self.steps = 0  # steps run in C (tests read it)
        self.shared_steps = 0  # of them, steps that read shared KV
        self._refusals: set[str] = set()  # why a step went to the tensor ops, each logged once
        # the last shared KV's parts as the C step reads them: a batch's SharedKV serves all its steps
        self._parts: tuple[weakref.ref, Any, list[torch.Tensor]] | None = None
        # 8: products multiply inputs quantized to 8 bits a block (weights="int4-a8": every layer asked for it);
        # 16: the 4-bit ones to 16 bits (weights="int4" where the CPU has AVX512-VNNI: a16_kernels.c); else float32
        asked = {linear.decode_activation_bits for linear in self.linears}
        self.activation_bits = 8 if asked == {8} else 16 if asked == {16} and self.lib.a16_kernels(-1) else 32
        # cos/sin by position, filled by the model's rotary module, a table per layer type where they differ (Gemma 3's local
        # and global layers); None: its frequencies follow the input (the module is called at every step)
        tables = {kind: RopeTable.build(step.rotary, step.norm.weight, kind) for kind in step.rope_kinds}
        self.ropes: dict[str | None, RopeTable] | None = tables if all(tables.values()) else None
        self.activation = ACTIVATION_CODES[step.activation_name]  # llama_step.c's code for the MLP's activation
        self._build()

    @classmethod
    def build(cls, step: Any) -> FusedStep | None:
        """The C step for ``step``, or None where it cannot run one (:func:`unfused`)."""
        return None if unfused(step) is not None else cls(step)

    def _build(self) -> None:
        """The layers' weights as the C step reads them (again when a weight was replaced: a model moved or cast)."""
        self.generation = blocks.weights_generation()  # before reading: a change while building shows at the next step
        hidden, query, key, inner = self.hidden, self.step.heads * self.head_dim, self.step.kv_heads * self.head_dim, self.intermediate
        shapes = {"q": (query, hidden), "k": (key, hidden), "v": (key, hidden), "o": (hidden, query), "gate": (inner, hidden),
                  "up": (inner, hidden), "down": (hidden, inner)}
        layers = (Layer * len(self.step.layers))()
        widths = {"query_norm": self.head_dim if self.step.layers[0].per_head else query,
                  "key_norm": self.head_dim if self.step.layers[0].per_head else key}
        # the norms' memory, held: a weight whose .data is swapped (not seen, see weights_generation) leaves the step
        # reading its old values, never freed memory
        self._norm_storages = []
        for into, layer in zip(layers, self.step.layers):
            for name in NORMS:
                norm = getattr(layer, name)
                if norm is not None:
                    checked(name, norm, torch.float32, (widths.get(name, hidden),))
                    self._norm_storages.append(norm.untyped_storage())
                setattr(into, name, _pointer(norm))
            for name in SCALARS:
                setattr(into, name, getattr(layer, name))
            into.per_head = layer.per_head
            for name in LINEARS:
                setattr(into, name, _product(getattr(layer, name), shapes[name]))
        checked("final_norm", self.step.norm.weight, torch.float32, (hidden,))
        self.layers = layers
        self.head = _product(self.step.head, (self.step.head.out_features, hidden)) if self.head_in_c else Product()

    def _weights_current(self) -> bool:
        """Whether the layers' tensors are those :meth:`_build` read, rebuilding where any may have been
        replaced since and the step can still run them."""
        if blocks.weights_generation() == self.generation:
            return True
        if unfused(self.step) is not None or any(linear.scales.dtype != torch.float32 or linear.scales.device.type != "cpu"
                                                  for linear in self.linears):
            return False
        self._build()
        return True

    def _mask(self, mask: torch.Tensor | None, rows: int, entries: int) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """``mask`` as the C step reads it: (additive, kept), each ``[rows, entries]`` or None; None: not one it reads."""
        if mask is None:
            return None, None
        if mask.dim() != 4 or mask.shape[1:3] != (1, 1) or mask.shape[0] not in (1, rows) or mask.shape[3] != entries:
            return None
        flat = (mask.view(rows, entries) if mask.shape[0] == rows and mask.is_contiguous()
                else mask.expand(rows, 1, 1, entries).reshape(rows, entries).contiguous())
        if mask.dtype == torch.bool:
            return None, flat.view(torch.uint8)
        return (flat, None) if mask.dtype == torch.float32 else None

    def _masks(self, mask: torch.Tensor | dict[str, torch.Tensor] | None, rows: int,
               entries: int) -> dict[str | None, tuple[torch.Tensor | None, torch.Tensor | None] | None]:
        """:meth:`_mask` of ``mask``, or of each layer type's where it is a dict of them (None: all layers')."""
        if isinstance(mask, dict):
            return {kind: self._mask(mask.get(kind), rows, entries) if kind in mask else None for kind in set(self.step.layer_types)}
        return {None: self._mask(mask, rows, entries)}

    def _rope_tables(self, state: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """cos and signed sin ``[rows, head_dim]`` at ``positions``, by layer type (None: every layer's): from the
        table where it serves, else from the model's rotary module (once per layer type)."""
        rows = state.shape[0]
        ropes = self.ropes
        tables = {kind: table.rows(positions) for kind, table in ropes.items()} if ropes is not None else {}
        if not tables or any(rows_ is None for rows_ in tables.values()):  # no table, or a hook asks for the module
            tables = {kind: (cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous())
                      for kind, (cos, sin) in self.step.rope(state[:, None], positions).items()}
        for cos, sin in tables.values():
            checked("cos", cos, torch.float32, (rows, self.head_dim))
            checked("sin", sin, torch.float32, (rows, self.head_dim))
        return tables

    def _claim(self, layers: Any, rows: int) -> tuple[int, int]:
        """The entry this step writes and the entries it attends (the new one included), checked within the
        KV storage before anything is claimed: a full buffer raises here, as the tensor ops' step would."""
        first = layers[0]
        if first.column is not None:  # a fixed buffer: its cursor tensor, shared by every layer (read once)
            column, entries = int(first.column), first.keys.shape[-2]
        else:  # a growing one: the next entry, claimed by step_storage below (which checks the capacity)
            column, entries = first.keys.shape[-2], first.keys.shape[-2] + 1
        capacity = first.capacity
        if not 0 <= column < entries <= capacity:
            raise PromptCacheError(f"KV buffer overflow: a decode step writes entry {column} and reads {entries} of a "
                                   f"buffer holding {capacity}")
        return column, entries

    def _pointed(self, layers: Any, rows: int) -> tuple[ctypes.Array, tuple[int, ...], tuple[int, ...]]:
        """This call's copy of the layers (another thread may step another cache), each pointed at its KV
        storage, every layer's checked as ``[rows, kv_heads, capacity, head_dim]`` in the first's dtype, with its
        strides; that shape and those strides."""
        step_layers = type(self.layers).from_buffer_copy(self.layers)
        shape = strides = None
        for into, layer in zip(step_layers, layers):  # past every refusal: claiming an entry grows a growing cache
            layer_keys, layer_values, _ = layer.step_storage()
            if shape is None:
                shape, strides = tuple(layer_keys.shape), layer_keys.stride()
                if shape[:2] != (rows, self.step.kv_heads) or shape[3:] != (self.head_dim,) or strides[-1] != 1:
                    raise PromptCacheError(f"a KV buffer of shape {list(shape)} (strides {strides}) is not [{rows} rows, "
                                           f"{self.step.kv_heads} key heads, entries, {self.head_dim}] over whole entries")
            for tensor in (layer_keys, layer_values):
                if (tuple(tensor.shape) != shape or tensor.stride() != strides or tensor.dtype != layers[0].keys.dtype
                        or tensor.device.type != "cpu"):
                    raise PromptCacheError(f"a KV buffer's layers differ in layout: {tensor.dtype} {list(tensor.shape)} "
                                           f"(strides {tensor.stride()}) against {layers[0].keys.dtype} {list(shape)} ({strides})")
            into.keys, into.values = layer_keys.data_ptr(), layer_values.data_ptr()
        assert shape is not None and strides is not None
        return step_layers, shape, strides

    def refused(self, why: str) -> None:
        """A step handed back to the tensor ops, and why: logged once a reason."""
        if why not in self._refusals:
            self._refusals.add(why)
            logger.info("a decode step runs as tensor ops, not in C: %s", why)

    def _shared_parts(self, shared: SharedStep, rows: int, dtype: torch.dtype) -> tuple[Any, int] | str:
        """``shared``'s parts as the C step reads them (an array of :class:`Shared` and its length), each
        checked here; or why the C step cannot read them."""
        kv = shared.shared
        held = self._parts
        if held is None or held[0]() is not kv:
            built = self._build_parts(kv, rows, dtype)
            if isinstance(built, str):
                return built
            held = self._parts = (weakref.ref(kv), *built)
        low = shared.bounds[0]
        if any(low <= group.last_position for group in kv.groups):
            return "a query does not see every key of the KV it shares (a mask over shared parts)"
        if any(rows <= max(row_list(group.rows)) for group in kv.groups):
            return "shared KV read by rows the step does not have"
        return held[1], len(held[1])

    def _build_parts(self, kv: SharedKV, rows: int, dtype: torch.dtype) -> tuple[Any, list[torch.Tensor]] | str:
        layers, kv_heads, dim = len(self.layers), self.step.kv_heads, self.head_dim
        parts = [(group, index, part) for group in kv.groups for index, part in enumerate(group.parts)]
        if len(parts) > MAX_SHARED:
            return f"{len(parts)} shared parts, more than the {MAX_SHARED} a step reads"
        array, alive = (Shared * len(parts))(), []
        for into, (group, index, part) in zip(array, parts):
            tensor = part.kv
            if tensor.dtype != dtype or tensor.device.type != "cpu":
                return f"shared KV in {tensor.dtype} on {tensor.device.type}, not the rows' {dtype} on a CPU"
            if (tensor.dim() != 5 or tuple(tensor.shape[:3]) != (layers, 2, kv_heads) or tensor.shape[4] != dim
                    or tensor.shape[3] < 1 or tensor.stride(-1) != 1 or min(tensor.stride()) < 0):
                return (f"a shared part of shape {list(tensor.shape)} (strides {tensor.stride()}) is not [{layers} layers, 2, "
                        f"{kv_heads} key heads, entries, {dim}] over whole entries")
            reading = torch.tensor(row_list(group.rows), dtype=torch.int64)
            into.keys, into.values = tensor[0, 0].data_ptr(), tensor[0, 1].data_ptr()
            into.entries, into.layer_stride, into.head_stride, into.entry_stride = tensor.shape[3], *tensor.stride()[:1], *tensor.stride()[2:4]
            into.rows, into.n_rows = reading.data_ptr(), len(reading)
            into.score_scale, into.log_scale = 1.0 / part.temperature, part.log_scale
            alive += [tensor, reading]
            if group.cos is not None:
                if group.per_layer or group.interleaved:
                    return "shared parts moved by per-layer or interleaved RoPE"
                cos, sin = group.cos[index].reshape(-1), group.sin[index].reshape(-1)
                if cos.numel() != dim:
                    return f"shared parts moved by RoPE over {cos.numel()} of {dim} dims"
                cos, sin = cos.float().contiguous(), signed_sin(sin.float()).contiguous()
                into.cos, into.sin = cos.data_ptr(), sin.data_ptr()
                alive += [cos, sin]
        return array, alive

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Any,
                 extents: RowExtents | None = None, shared: SharedStep | None = None) -> torch.Tensor | None:
        rows = ids.shape[0]
        layers = getattr(cache, "layers", ())
        if ids.dim() != 2 or ids.shape[1] != 1 or len(layers) != len(self.layers) or not hasattr(layers[0], "step_storage"):
            return None
        keys = layers[0].keys
        if keys.dtype not in KV_KINDS or keys.device.type != "cpu" or keys.shape[0] != rows or keys.stride(-1) != 1:
            return None
        by_type = self._masks(mask, rows, keys.shape[-2] + (layers[0].column is None))
        if any(masks is None for masks in by_type.values()) or not self._weights_current() or any(self.hooks):
            return None
        parts: tuple[Any, int] | str = (None, 0)
        if shared is not None and shared.shared.groups:
            parts = self._shared_parts(shared, rows, keys.dtype)
            if isinstance(parts, str):
                self.refused(parts)
                return None
        state = self.step.embed(ids.reshape(rows))  # [rows, hidden], a new tensor the step writes
        if self.step.embedding_scale != 1.0:
            state = state * self.step.embedding_scale
        tables = self._rope_tables(state, positions)
        column, entries = self._claim(layers, rows)
        step_layers, shape, strides = self._pointed(layers, rows)
        for into, layer in zip(step_layers, self.step.layers):  # each layer's RoPE and mask: its type's, or the step's one
            cos, sin = tables[layer.layer_type if None not in tables else None]
            mask_add, mask_keep = by_type[layer.layer_type if None not in by_type else None]
            into.cos, into.sin = (cos.data_ptr(), sin.data_ptr()) if layer.rotates else (None, None)  # null: no RoPE (SmolLM3)
            into.mask_add, into.mask_keep = _pointer(mask_add), _pointer(mask_keep)
        lo = hi = None
        if extents is not None:
            lo, hi = torch.full((rows,), -1, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
            for taken, span in extents.spans():
                if not 0 <= span.start <= span.stop <= entries:
                    raise PromptCacheError(f"rows attend entries [{span.start}, {span.stop}), not within the {entries} a step reads")
                lo[taken], hi[taken] = span.start, span.stop
        checked("state", state, torch.float32, (rows, self.hidden))
        args = Step(ctypes.addressof(step_layers), len(step_layers), rows, self.hidden, self.step.heads, self.step.kv_heads,
                    self.head_dim, self.intermediate, state.data_ptr(), self.step.norm.weight.data_ptr(), self.step.final_eps,
                    self.step.family.norm_offset, self.activation, column, entries, shape[2], *strides[:3], _pointer(lo),
                    _pointer(hi), None, 0, torch.get_num_threads())
        args.shared, args.n_shared = (ctypes.addressof(parts[0]) if parts[1] else None), parts[1]
        args.kv_kind = KV_KINDS[keys.dtype]
        floats = self.lib.llama_step_work(ctypes.byref(args))
        if floats < 0:
            raise PromptCacheError("the C decode step refused the shared KV it was given (a row outside the step, no entries)")
        work = torch.empty(floats)
        args.work, args.work_floats = work.data_ptr(), work.numel()
        logits = torch.empty(rows, self.step.head.out_features) if self.head_in_c else None
        args.head, args.logits, args.activation_bits = self.head, _pointer(logits), self.activation_bits
        refused = self.lib.llama_step(ctypes.byref(args))
        if refused:
            raise PromptCacheError(f"the C decode step refused its arguments ({'entries outside the KV storage' if refused == -2 else ''}"
                                   f"{work.numel()} work floats, head dim {self.head_dim}, column {column} of {shape[2]})")
        self.steps += 1
        self.shared_steps += parts[1] > 0
        return self.step.scaled_logits(logits if logits is not None else self.step.head(state.view(rows, 1, self.hidden))[:, -1])
