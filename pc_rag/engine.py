"""``PromptCache``: the one object users hold. It wires the parts and holds no algorithm.

    prompt -> planner.plan(snapshot) -> Plan -> planner.recover -> planner.admit
           -> Assembler.assemble(store) -> generate.prefill -> generate.decode -> Generation

``model.inspect_model`` measures the model once (:class:`~pc_rag.model.ModelSpec`);
``registry.Registry`` holds schemas and documents and publishes immutable snapshots;
``encoder.ModuleEncoder`` puts module KV into the ``store.ModuleStore``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch

from . import planner
from .assemble import Assembler, Assembly, choose_assembly
from .documents import DEFAULT_SCHEMA, SEPARATOR
from .encoder import Forward, ModuleEncoder
from .errors import PromptCacheError
from .generate import Rows, decode, prefill, prefill_in_order
from .generation import Generation, RequestState, SamplingParams, StreamingGeneration
from .kvcache import BufferPool
from .layout import Plan
from .model import ModelSpec, RopeRotator, inspect_model, load_model, render_chat
from .registry import Registry, Schema
from .store import open_store

logger = logging.getLogger(__name__)

Encoding = Literal["isolated", "shared_prefix", "scaffold"]
ENCODINGS: tuple[str, ...] = ("isolated", "shared_prefix", "scaffold")
# shared_prefix: every module sees the schema's system prompt, as it would in full prefill, so the
# first module after it is exact and no module's first token becomes a spurious attention sink.
# scaffold: a PML schema is encoded jointly along its paths (the reference implementation's
# scaffolds): every module sees all the schema text before it; documents as with shared_prefix.
DEFAULT_ENCODING: Encoding = "shared_prefix"
# Recovery: tokens recomputed at the head (EPIC-style) and at the tail of every imported module
# that was not encoded behind exactly what precedes it (benchmarks/quality.py measured the choice;
# see README)
DEFAULT_RECOMPUTE = 4
DEFAULT_RECOMPUTE_TAIL = 1
DEFAULT_ASSEMBLY: Assembly = "copy"

__all__ = ["DEFAULT_ENCODING", "DEFAULT_RECOMPUTE", "DEFAULT_RECOMPUTE_TAIL", "PromptCache", "Schema"]


class PromptCache:
    """Prompt Cache over a Hugging Face causal LM.

    Build one with :meth:`from_pretrained`, register schemas with :meth:`add_schema` (or documents
    with :meth:`add_documents`), then call :meth:`generate`, :meth:`stream` or
    :meth:`generate_batch` with PML prompts (``<prompt schema="...">``) or plain text.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        encoding: Encoding | None = None,
        cache_dir: str | os.PathLike | None = None,
        memory_budget: int | None = None,
        store_dtype: torch.dtype | None = None,
        kv_location: Literal["device", "cpu"] = "device",
        drop_in: bool = True,
        recompute: int | None = None,
        recompute_tail: int | None = None,
        assembly: Assembly | None = None,
    ) -> None:
        encoding = encoding or DEFAULT_ENCODING
        if encoding not in ENCODINGS:
            raise PromptCacheError(f"unknown encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
        if memory_budget is not None and memory_budget < 0:
            raise PromptCacheError(f"memory_budget must be a number of bytes >= 0, got {memory_budget!r}")
        if kv_location not in ("device", "cpu"):
            raise PromptCacheError(f"kv_location must be 'device' or 'cpu', got {kv_location!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.encoding: Encoding = encoding
        self.spec: ModelSpec = inspect_model(model, tokenizer, separator=SEPARATOR)
        self.recompute = planner.recovery_tokens(recompute, "recompute", DEFAULT_RECOMPUTE, self.spec)
        self.recompute_tail = planner.recovery_tokens(recompute_tail, "recompute_tail", DEFAULT_RECOMPUTE_TAIL, self.spec)
        self.assembly: Assembly = choose_assembly(assembly, DEFAULT_ASSEMBLY, self.spec)
        self.fingerprint = hashlib.sha256(f"{self.spec.fingerprint}|{encoding}".encode()).hexdigest()[:32]
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        store_device = self.spec.device if kv_location == "device" else torch.device("cpu")
        kv_dtype = store_dtype or self.spec.dtype
        self._kv_bytes_per_token = self.spec.kv_bytes_per_token(kv_dtype)
        self.store = open_store(
            fingerprint=self.fingerprint, cache_dir=self.cache_dir, memory_budget=memory_budget, device=store_device,
            kv_dtype=kv_dtype, pin=store_device.type == "cpu" and self.spec.device.type == "cuda",
        )
        self.forward = Forward(model)
        self.encoder = ModuleEncoder(self.forward, self.store, self.spec, encoding, self.fingerprint)
        # verbatim module texts, for drop-in reuse in plain prompts (only where modules can move)
        # (aligned through character offsets: a fast tokenizer's)
        self.drop_in = drop_in and self.spec.movable and bool(getattr(tokenizer, "is_fast", False))
        self.registry = Registry(self.spec, self.encoder, encoding=encoding, drop_in=self.drop_in)
        self.buffers = BufferPool(model)
        self.assembler = Assembler(self.spec, self.encoder, self.buffers)
        # tokens that end an answer (EOS, end of turn); empty it for fixed-length generations
        self.stop_token_ids: set[int] = set(self.spec.stop_token_ids)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None, encoding: Encoding | None = None,
                        cache_dir: str | os.PathLike | None = None, memory_budget: int | None = None,
                        store_dtype: torch.dtype | None = None, kv_location: Literal["device", "cpu"] = "device",
                        drop_in: bool = True, recompute: int | None = None, recompute_tail: int | None = None,
                        assembly: Assembly | None = None, **model_kwargs: Any) -> "PromptCache":
        """Load a model (hub id, local folder, or ``None`` for the embedded SmolLM2-135M-Instruct)."""
        lm, tokenizer = load_model(model, device=device, dtype=dtype, **model_kwargs)
        return cls(lm, tokenizer, encoding=encoding, cache_dir=cache_dir, memory_budget=memory_budget, store_dtype=store_dtype,
                   kv_location=kv_location, drop_in=drop_in, recompute=recompute, recompute_tail=recompute_tail, assembly=assembly)

    # -- facts about the model (see ModelSpec) ----------------------------------------------------
    @property
    def position_kind(self) -> str:
        return self.spec.position_kind

    @property
    def movable(self) -> bool:
        """Whether cached modules can be placed at positions other than those they were encoded at."""
        return self.spec.movable

    @property
    def rotator(self) -> RopeRotator | None:
        return self.spec.rotator

    @property
    def split(self) -> bool:
        return self.spec.split

    @property
    def markers(self) -> Any:
        return self.spec.markers

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def context_window(self) -> int | None:
        return self.spec.context_window

    @property
    def separator_ids(self) -> list[int]:
        return list(self.spec.separator_ids)

    @property
    def schemas(self) -> Mapping[str, Schema]:
        """The schemas registered now (a read-only snapshot)."""
        return self.registry.snapshot().schemas

    def tokenize(self, text: str) -> list[int]:
        return self.spec.tokenize(text)

    def store_stats(self) -> dict[str, int]:
        """Where module KV came from since this engine started: ``encoded`` (modules encoded by
        this process), ``hits_memory``, ``hits_disk``, ``hits_remote`` (0: no remote tier yet),
        ``misses`` (lookups no tier could answer), ``evictions``, ``bytes_memory``, ``bytes_disk``."""
        return {"encoded": self.forward.encoded, **self.store.stats()}

    # -- registration ---------------------------------------------------------------------------
    def add_schema(self, pml: str, *, progress: bool = True) -> Schema:
        """Parse a schema and encode all its modules (loaded from ``cache_dir`` when present)."""
        return self.registry.add_schema(pml, progress=progress)

    def add_documents(self, texts: Sequence[Any], *, ids: Sequence[str] | None = None,
                      metadatas: Sequence[dict[str, Any] | None] | None = None, schema: str = DEFAULT_SCHEMA,
                      system: str | None = None, progress: bool = True, batch_tokens: int | None = None) -> list[str]:
        """Store documents as movable modules of the document schema ``schema``; return their names.

        ``texts`` holds strings, LangChain ``Document``s or LlamaIndex nodes. A document's name is
        its id (``ids``, or the Document/node id when that is a valid module name), otherwise one
        derived from its text, so adding the same text twice stores it once. Documents are
        encoded behind the schema's system prompt (``system``; fixed when the schema is created),
        several per forward pass (up to ``batch_tokens`` padded tokens; by default 512 on CPU,
        where a 2-core machine is compute-bound at batch 1 and padding only adds work, and 8192
        on accelerators), and persisted through ``cache_dir``. A prompt places the documents it
        imports one after another, right after the system turn and the user marker, at the
        positions full prefill would give them.
        """
        return self.registry.add_documents(texts, ids=ids, metadatas=metadatas, schema=schema, system=system,
                                           progress=progress, batch_tokens=batch_tokens)

    # -- serving ------------------------------------------------------------------------------------
    def plan(self, prompt: str) -> Plan:
        """Which tokens of ``prompt`` are cached and which computed, at which positions."""
        planned = planner.plan(prompt, self.registry.snapshot(), self.spec, encoding=self.encoding, drop_in=self.drop_in)
        return planner.recover(planned, head=self.recompute, tail=self.recompute_tail, encoding=self.encoding)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """``[{"role", "content"}]`` as the model's chat template renders them, ending with the generation prompt.

        The result is a plain prompt: module references and verbatim document text inside the
        messages are reused like anywhere else; nothing in a message is read as PML.
        """
        return render_chat(self.tokenizer, self.spec.markers, messages)

    def next_token_logits(self, prompt: str, *, use_cache: bool = True) -> torch.Tensor:
        """Logits of the first generated token: the quantity cached inference must reproduce."""
        plans = self._prepare([prompt], use_cache)
        rows, logits, _, _ = self._prefill(plans, 0, use_cache, share=False)
        self.buffers.release(rows.buffer)
        return logits[0]

    def generate(self, prompt: str, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int | None = None, stop: str | Sequence[str] | None = None, use_cache: bool = True,
                 seed: int | None = None, **generation: Any) -> Generation:
        """Generate a completion; ``use_cache=False`` runs full prefill of the same token sequence.

        ``generation`` takes transformers' names, with its meaning: ``do_sample``,
        ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ``stop_strings``.
        """
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             stop=stop, use_cache=use_cache, seed=seed, **generation)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int | None = None, stop: str | Sequence[str] | None = None, use_cache: bool = True,
               seed: int | None = None, **generation: Any) -> StreamingGeneration:
        """Like :meth:`generate`, yielding text as it is decoded; ``.result`` holds the Generation.

        The prompt is planned (and refused, if it cannot be served) now; it is prefilled on the
        first ``next()``, on the KV it was planned with.
        """
        started = time.perf_counter()
        params = _sampling(max_new_tokens, temperature, top_p, top_k, stop, seed, generation)
        plans = self._prepare([prompt], use_cache)
        return StreamingGeneration(self._run(plans, params, use_cache, started, share=False))

    def generate_batch(self, prompts: Sequence[str], *, max_new_tokens: int = 256, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int | None = None, stop: str | Sequence[str] | None = None,
                       use_cache: bool = True, seed: int | None = None, share_modules: bool = True, **generation: Any) -> list[Generation]:
        """Generate completions for several prompts together: one forward pass per step for all.

        Every prompt is planned first, so every error surfaces before any work. With
        ``share_modules`` (RoPE models on SDPA), cached KV that several prompts import at the same
        positions is held once and attended to once per step for all of them (shared-module
        attention, see :mod:`pc_rag.shared_attention`); what each prompt computes is prefilled in
        one batched pass. Greedy outputs equal those of :meth:`generate` called on each prompt.
        Models whose attention cannot take per-row masks (ALiBi, learned positions, flash/flex
        attention) are served one prompt after another.
        """
        if isinstance(prompts, str):
            raise PromptCacheError("generate_batch takes a sequence of prompts; use generate() for one")
        prompts = list(prompts)
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed)
        params = _sampling(max_new_tokens, temperature, top_p, top_k, stop, seed, generation)  # bad arguments fail first
        if len(prompts) <= 1 or not self.spec.one_pass:
            return [self.generate(p, use_cache=use_cache, **kwargs, **generation) for p in prompts]  # type: ignore[arg-type]
        started = time.perf_counter()
        plans = self._prepare(prompts, use_cache)
        run = self._run(plans, params, use_cache, started, share=share_modules and self.spec.split)
        try:
            while True:
                next(run)
        except StopIteration as done:
            return done.value

    # -- the chain -----------------------------------------------------------------------------
    def _prepare(self, prompts: Sequence[str], use_cache: bool) -> list[Plan]:
        """Plan every prompt and refuse, before any work, what cannot be served."""
        plans = []
        for index, prompt in enumerate(prompts):
            try:
                plans.append(self.plan(prompt))
            except PromptCacheError as err:
                if len(prompts) > 1:
                    raise PromptCacheError(f"prompt {index}: {err}") from err
                raise
        planner.admit(plans, self.spec, use_cache=use_cache, memory_budget=self.store.memory_budget,
                      kv_bytes_per_token=self._kv_bytes_per_token)
        return plans

    def _prefill(self, plans: list[Plan], new_tokens: int, use_cache: bool, *, share: bool) -> tuple[Rows, torch.Tensor, list[int], float]:
        """Assemble and prefill ``plans``: the rows (room for ``new_tokens`` more), the first
        logits, the row order and when assembly ended."""
        if not self.spec.one_pass:  # attention that reads cache order: one row, segment by segment
            (plan,) = plans
            rows = self.assembler.empty_row(len(plan.input_ids) + new_tokens)
            if not use_cache:
                plan = Plan([replace(s, owner=None) for s in plan.segments], plan.modules)
            return rows, prefill_in_order(self.forward, rows, plan, self.assembler.append), [0], time.perf_counter()
        assembled = self.assembler.assemble(plans, new_tokens, use_cache=use_cache, assembly=self.assembly, share=share)
        assembled_at = time.perf_counter()
        return assembled.rows, prefill(self.forward, assembled.rows, assembled.inputs, self.spec), assembled.order, assembled_at

    def _run(self, plans: list[Plan], params: SamplingParams, use_cache: bool, started: float, *, share: bool
             ) -> Generator[str, None, Any]:
        """Prefill and decode ``plans`` together; yields the text of a single request as it is
        decoded, and returns its Generation (a list of them for a batch)."""
        spec = self.spec
        requests = [
            RequestState(params=params, tokenizer=self.tokenizer, device=spec.device, stop_token_ids=frozenset(self.stop_token_ids),
                         context_window=spec.context_window, modules=list(p.modules),
                         cached_tokens=p.cached_tokens if use_cache else 0,
                         computed_tokens=p.computed_tokens if use_cache else len(p.input_ids), next_position=p.end, started=started,
                         prompt_ids=p.input_ids if params.reads_history else ())
            for p in plans
        ]
        rows, logits, order, assembled_at = self._prefill(plans, max(r.budget for r in requests), use_cache, share=share)
        requests = [requests[i] for i in order]
        for request in requests:
            request.stats.assemble_s = assembled_at - started
        single = len(requests) == 1
        try:
            for deltas in decode(self.forward, rows, requests, logits, spec):
                if single and deltas[0]:
                    yield deltas[0]
        finally:  # also when a stream is closed or collected half-way: the buffer goes back to the pool
            if rows.batch == 1:
                self.buffers.release(rows.buffer)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("store after request: %s", {"encoded": self.forward.encoded, **self.store.stats(scan_disk=False)})
        results: list[Generation] = [None] * len(requests)  # type: ignore[list-item]
        for request, index in zip(requests, order):
            tail, results[index] = request.close()
            if single and tail:
                yield tail
        return results[0] if single else results


GENERATION_ARGUMENTS = ("do_sample", "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "stop_strings")


def _sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int | None, stop: Any, seed: int | None,
              generation: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(generation) - set(GENERATION_ARGUMENTS))
    if unknown:
        raise PromptCacheError(f"unknown generation arguments: {', '.join(unknown)} (known besides the named ones: "
                               f"{', '.join(GENERATION_ARGUMENTS)})")
    return SamplingParams.build(max_new_tokens, temperature, top_p, top_k, stop, seed, **generation)
