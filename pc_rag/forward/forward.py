"""``Forward``: every pass pc-rag runs through a model (module encoding, prefill, probing, decode
steps), with the keyword arguments its attention kernels read (positions, shared KV, the probe)."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import forks
from ..errors import PromptCacheError
from ..kv.buffers import KVBuffer, ModuleKV
from ..weights.blocks import BlockLinear
from .attention import ATTENTION_NAME
from .decoder import decoder_of, language_model_of
from .llama_step import LlamaDecodeStep, written_step
from .packed import KWARG as PACKED_KWARG
from .packed import PackedStep, Pass
from .probe import PROBE_KWARG, Probe, ProbeDone
from .row_extents import KWARG as EXTENTS_KWARG
from .row_extents import RowExtents
from .shared_attention import KWARG, SharedKV
from .threads import DecodeThreads, narrow_pass
from .turns import ModelTurns


def _shared_kwargs(shared: SharedKV | None, positions: torch.Tensor, bounds: tuple[int, int] | None) -> dict[str, Any]:
    """The forward keyword that hands shared KV to the attention function (none without it)."""
    return {} if shared is None else {KWARG: shared.for_queries(positions, bounds)}


def cache_keyword(model: Any) -> str:
    """The keyword ``model``'s forward takes its KV cache under: ``cache`` where transformers has
    renamed ``past_key_values`` (5.x; the old name is removed in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(decoder_of(model).forward).parameters else "past_key_values"


@dataclass
class NewTokens:
    """One batch's new tokens for a packed forward pass (:meth:`Forward.packed`)."""

    buffer: KVBuffer  # the batch's cache: the tokens' KV goes there, their queries read it
    ids: torch.Tensor  # [rows, width]
    positions: torch.Tensor  # [rows, width]
    mask: Any  # the batch's attention mask over its buffer and the new tokens (never None)
    shared: SharedKV | None  # KV the rows read in place
    bounds: tuple[int, int]  # the smallest and largest of ``positions`` (on the host)
    extents: RowExtents | None = None  # a decode step's rows attend within these (pc_rag.forward.row_extents)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def compile_mode(compile: bool | str) -> str | None:
    """The ``torch.compile`` mode a ``compile`` setting asks for: None for eager (False), "default"
    for True, or one of :data:`COMPILE_MODES` by name."""
    if compile is False:
        return None
    if compile is True:
        return "default"
    if isinstance(compile, str) and compile in COMPILE_MODES:
        return compile
    raise PromptCacheError(f"compile must be True, False or one of {', '.join(map(repr, COMPILE_MODES))}, got {compile!r}")


def _mark_dynamic_keys(mask: Any) -> None:
    """The key dimension of a decode step's mask (one tensor, or one per layer type) is symbolic
    to torch.compile, as the KV buffer's capacity is (:meth:`KVBuffer.mark_dynamic_capacity`)."""
    for tensor in mask.values() if isinstance(mask, dict) else (mask,):
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(tensor, tensor.dim() - 1)


class Forward:
    """Runs the model over new tokens at explicit positions, appending to a :class:`KVBuffer`.

    Counts its work (thread-safe): ``passes`` (forward passes of any kind) and ``encoded``
    (token sequences encoded as module KV). Tests use them to prove that a cache hit runs no
    forward pass and that concurrent callers encode every module once.
    """

    def __init__(self, model: Any, *, compile: bool | str = False, turns: ModelTurns | None = None, written: bool = False,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = language_model_of(model)  # a multimodal wrapper's language model: text is all pc-rag runs
        self.kv_dtype = kv_dtype  # the KV buffers it allocates (default: the model's dtype)
        self.decoder = decoder_of(model)  # the stack under the head: KV without logits for every token
        self._cache = cache_keyword(model)
        # decode steps with fixed shapes (pc_rag.decode.loop.Cursor) through torch.compile. dynamic=None:
        # a second batch size or capacity recompiles once with that size symbolic, so a served batch
        # changing shape from step to step compiles a few times (compiled per exact shape, dynamo's
        # recompile limit of 8 was reached within seconds of serving and every later shape ran
        # eagerly); CUDA graphs ("reduce-overhead") are still recorded per concrete shape
        self.compile_mode = compile_mode(compile)
        self._decode_step = (torch.compile(self._model_step, dynamic=None, mode=self.compile_mode)
                             if self.compile_mode is not None else None)
        self.compiled_steps = 0  # decode steps run compiled
        self.compiled_shapes: set[tuple[int, int]] = set()  # the (rows, capacity) they ran at: a CUDA graph each
        # eager decode steps of a Llama-family model written out, without transformers' module code
        # (pc_rag.forward.llama_step), where ``written`` asks for it and it proves equal to the model's own
        self.written_step: LlamaDecodeStep | None = None
        if written and self._decode_step is None:
            split = getattr(self.model.config, "_attn_implementation", None) == ATTENTION_NAME
            self.written_step = written_step(model, self._model_step, split=split)
        self.decode_threads = DecodeThreads(model.device)  # a CPU's decode steps: one thread or all, measured
        # a cached prompt's few computed tokens: torch's small ops on one thread, the kernels' products on all (narrow_pass)
        linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, BlockLinear))]
        self.narrow_passes = torch.device(model.device).type == "cpu" and bool(linears) and all(isinstance(m, BlockLinear) for m in linears)
        # what transformers is handed as the mask of a packed pass (a 4D mask passes through as it
        # is; each pass applies its own): made once, not per step
        self._placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=model.device)
        self.passes = 0
        self.encoded = 0
        self._count_lock = threading.Lock()
        forks.renew_after_fork(self, "_count_lock")
        # the model's turns: the scheduler's steps and the background encoder's documents (pc_rag.forward.turns)
        self.turns = turns if turns is not None else ModelTurns()

    @property
    def compiled(self) -> bool:
        """Whether decode steps run through torch.compile."""
        return self._decode_step is not None

    @property
    def decodes_in_c(self) -> bool:
        """Whether decode steps run in one C call (:mod:`pc_rag.forward.fused_step`: blocks on pc-rag's kernels)."""
        return self.written_step is not None and self.written_step.fused is not None

    @torch.inference_mode()
    def time_prefill(self, tokens: int) -> float:
        """Seconds one prefill of ``tokens`` takes now (after a short warm-up pass), not counted
        among the passes: what load-or-compute needs before any request was served (pc_rag.kv.load_or_compute)."""
        device = self.model.device
        ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
        self.decoder(input_ids=ids[:, :8])  # first-call allocations and kernel choices
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        self.decoder(input_ids=ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    def _count(self, passes: int, encoded: int = 0) -> None:
        with self._count_lock:
            self.passes += passes
            self.encoded += encoded

    @torch.inference_mode()
    def __call__(
        self,
        buffer: KVBuffer,
        token_ids: Sequence[int],
        positions: Sequence[int],
        *,
        logits: bool,
        mask: torch.Tensor | None = None,
        shared: SharedKV | None = None,
    ) -> torch.Tensor | None:
        """Extend ``buffer`` with ``token_ids``; return the last token's logits when asked.

        ``mask`` (``[1, 1, new, buffer + new]``, see :func:`pc_rag.forward.attention.position_mask`)
        replaces the causal mask transformers would build from buffer order. ``shared`` is KV
        attended to besides the buffer, read in place (see :mod:`pc_rag.forward.shared_attention`).
        """
        positions = list(positions)
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        pos = torch.tensor([positions], dtype=torch.long)
        bounds = (min(positions), max(positions)) if shared is not None else None
        if logits:
            return self._step(buffer, ids, pos, mask, shared, bounds)[0]
        self._count(1)
        device = self.model.device
        pos = pos.to(device)
        self.decoder(
            input_ids=ids.to(device), position_ids=pos, attention_mask=mask, use_cache=True,
            **{self._cache: buffer.cache}, **_shared_kwargs(shared, pos, bounds),
        )
        return None

    def decode_batch(
        self, buffer: KVBuffer, ids: torch.Tensor, positions: torch.Tensor, bounds: tuple[int, int], mask: Any,
        shared: SharedKV | None = None, extents: RowExtents | None = None,
    ) -> torch.Tensor:
        """One decoding step for every row of a batched ``buffer``: ``ids [rows, 1]`` at ``positions
        [rows, 1]`` (their smallest and largest in ``bounds``): logits ``[rows, vocab]``. ``extents``:
        the rows attend within them (eager steps; see :mod:`pc_rag.forward.row_extents`)."""
        with self.decode_threads.step(ids.shape[0]):
            return self._decode_batch(buffer, ids, positions, bounds, mask, shared, extents)

    def _decode_batch(
        self, buffer: KVBuffer, ids: torch.Tensor, positions: torch.Tensor, bounds: tuple[int, int], mask: Any,
        shared: SharedKV | None, extents: RowExtents | None,
    ) -> torch.Tensor:
        if self._decode_step is not None and shared is None and buffer.fixed and buffer.spans_storage:
            self._count(1)
            self.compiled_steps += 1
            self.compiled_shapes.add((ids.shape[0], buffer.capacity))
            buffer.mark_dynamic_capacity()
            _mark_dynamic_keys(mask)
            with torch.inference_mode():
                if self.compile_mode != "reduce-overhead":
                    return self._decode_step(ids, positions, mask, buffer.cache)
                # a CUDA graph replay (on a CPU the step compiles as "default"): a graph writes the KV buffer in place: its storage is a static input (no copy in
                # and out per replay; guard=False: another buffer of the same shape re-records,
                # not recompiles), and the logits it returns are overwritten by the next replay
                buffer.mark_static()
                torch.compiler.cudagraph_mark_step_begin()
                return self._decode_step(ids, positions, mask, buffer.cache).clone()
        if self.written_step is not None and isinstance(mask, (torch.Tensor, dict)) and self.written_step.serves(shared, mask, extents):
            self._count(1)
            device = self.model.device
            positions = positions.to(device)
            view = None if shared is None else shared.for_queries(positions, bounds)
            return self.written_step(ids.to(device), positions, mask, buffer.cache, extents, view)
        return self._step(buffer, ids, positions, mask, shared, bounds, extents)

    def _model_step(self, ids: torch.Tensor, positions: torch.Tensor, mask: Any, cache: Any, **extra: Any) -> torch.Tensor:
        """The model over ``ids`` at ``positions``; the last token's logits (logits_to_keep=1: the
        vocabulary projection runs for it only)."""
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, logits_to_keep=1,
                         **{self._cache: cache}, **extra)
        return out.logits[:, -1]

    def prefill_batch(
        self, buffer: KVBuffer, ids: torch.Tensor, positions: torch.Tensor, mask: Any, shared: SharedKV | None = None,
        bounds: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Run ``ids [rows, n]`` (left-padded, so every row's last column is a real token) at
        ``positions`` (their smallest and largest in ``bounds``): the last column's logits, ``[rows, vocab]``."""
        with narrow_pass(ids.numel(), self.narrow_passes):
            return self._step(buffer, ids, positions, mask, shared, bounds)

    @torch.inference_mode()
    def _step(
        self, buffer: KVBuffer, ids: torch.Tensor, pos: torch.Tensor, mask: Any, shared: SharedKV | None = None,
        bounds: tuple[int, int] | None = None, extents: RowExtents | None = None,
    ) -> torch.Tensor:
        """Run ``ids [rows, n]`` at ``pos``; the last token's logits of each row, ``[rows, vocab]``."""
        self._count(1)
        device = self.model.device
        pos = pos.to(device)
        extra = {} if extents is None else {EXTENTS_KWARG: extents}
        return self._model_step(ids.to(device), pos, mask, buffer.cache, **_shared_kwargs(shared, pos, bounds), **extra)

    @torch.inference_mode()
    def packed(self, batches: Sequence[NewTokens], window_layers: Sequence[bool] = ()) -> list[torch.Tensor]:
        """Several batches' new tokens, each batch over its own cache, in one forward pass (see
        :mod:`pc_rag.forward.packed`): for each batch the last column's logits, ``[rows, vocab]``.
        Needs ``pc_rag_sdpa`` attention (``spec.split``); ``window_layers``: which layers slide."""
        self._count(1)
        device = self.model.device
        passes, ids, positions, keep = [], [], [], []
        start = 0
        for batch in batches:
            rows, width = batch.ids.shape
            pos = batch.positions.to(device)
            shared = None if batch.shared is None else batch.shared.for_queries(pos, batch.bounds)
            passes.append(Pass(batch.buffer, rows, width, batch.mask, shared, batch.extents))
            ids.append(batch.ids.reshape(-1))
            positions.append(pos.reshape(-1))
            keep.append(torch.arange(start + width - 1, start + rows * width, width))  # each row's last column
            start += rows * width
        # no cache object: the passes write their own caches in their attention
        out = self.model(input_ids=torch.cat(ids).to(device)[None], position_ids=torch.cat(positions)[None],
                         attention_mask=self._placeholder_mask, use_cache=False, logits_to_keep=torch.cat(keep).to(device),
                         **{PACKED_KWARG: PackedStep(passes, window_layers)})
        return list(out.logits[0].split([batch.ids.shape[0] for batch in batches]))

    @torch.inference_mode()
    def probe(self, buffer: KVBuffer, ids: torch.Tensor, positions: torch.Tensor, mask: Any, probe: Probe) -> None:
        """Run ``ids [rows, n]`` at ``positions`` through the probe's layers only (see
        :class:`pc_rag.forward.probe.Probe`); those layers' KV is left in ``buffer``, which still
        counts the entries it held before."""
        self._count(1)
        before = len(buffer)
        device = self.model.device
        try:
            self.decoder(input_ids=ids.to(device), position_ids=positions.to(device), attention_mask=mask,
                         use_cache=True, **{self._cache: buffer.cache, PROBE_KWARG: probe})
        except ProbeDone:
            pass
        buffer.grow_to(before)

    def encode(self, token_ids: Sequence[int], positions: Sequence[int], prefix: ModuleKV | None = None) -> ModuleKV:
        """The KV of ``token_ids`` at ``positions``, attending to ``prefix`` (if any) and to themselves."""
        before = len(prefix) if prefix is not None else 0
        buffer = KVBuffer.for_model(self.model, before + len(token_ids), dtype=self.kv_dtype)
        if prefix is not None:
            buffer.append(prefix.read(dtype=buffer.storage.dtype))
        self._count(0, 1)
        self(buffer, token_ids, positions, logits=False)
        kv = buffer.slice(before, before + len(token_ids)).clone()
        return ModuleKV(kv, torch.tensor(list(positions), dtype=torch.long))

    @torch.inference_mode()
    def encode_batch(
        self, sequences: Sequence[Sequence[int]], start: int, prefix: ModuleKV | None = None, *, pad_id: int = 0,
        keep_from: Sequence[int] | None = None,
    ) -> list[ModuleKV]:
        """The KV of several token sequences, each at positions ``start, start+1, ...`` behind ``prefix``.

        One forward pass for all: rows are right-padded, and since attention is causal a real
        token never sees the padding after it, so no mask is needed and each row's KV equals
        what :meth:`encode` gives it alone. ``keep_from[row]``: only that row's tokens from there
        on are returned (the ones before were its context: :mod:`pc_rag.prompt.neighbours`).
        """
        before = len(prefix) if prefix is not None else 0
        width = max(len(s) for s in sequences)
        buffer = KVBuffer.for_model(self.model, before + width, batch=len(sequences), dtype=self.kv_dtype)
        if prefix is not None:
            buffer.append(prefix.read(dtype=buffer.storage.dtype))
        device = self.model.device
        ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        positions = torch.arange(start, start + width, dtype=torch.long).expand(len(sequences), -1)
        self._count(1, len(sequences))
        self.decoder(input_ids=ids.to(device), position_ids=positions.to(device), use_cache=True,
                     **{self._cache: buffer.cache})
        kept = keep_from if keep_from is not None else [0] * len(sequences)
        return [
            ModuleKV(buffer.slice(before + skip, before + len(seq), row).clone(), torch.arange(start + skip, start + len(seq), dtype=torch.long))
            for row, (seq, skip) in enumerate(zip(sequences, kept))
        ]

    def keys_at(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Keys ``[layers, heads, n, dim]`` of ``token_ids`` encoded alone from position ``start``."""
        module = self.encode(token_ids, range(start, start + len(token_ids)))
        return module.kv[:, 0]
