"""``PromptCache``: the one object users hold. It wires the parts and holds no algorithm.

    prompt -> planner.plan(snapshot) -> Plan -> recovery.recover (head, tail) -> planner.admit
           -> Scheduler.submit ... [its loop] pipeline.prefill_plans: Assembler.assemble(store) [+ APE]
              -> generate.prefill [or the scored passes, pc_rag.prefill.scored]
              -> loop.RunningBatch (with other callers' rows) -> Generation

The public API's halves live in :mod:`pc_rag.registration` (schemas, documents, the shared
registry) and :mod:`pc_rag.serving` (the request above); this module builds the parts.

``model.inspect_model`` measures the model once (:class:`~pc_rag.model.spec.ModelSpec`);
``registry.Registry`` holds schemas and documents and publishes immutable snapshots;
``encoder.ModuleEncoder`` puts module KV into the ``store.ModuleStore``.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch

from . import planner
from .prefill import pipeline
from .prefill import recovery as recovery_mod
from .prefill.assemble import Assembler, Assembly, choose_assembly
from .background import BackgroundEncoder
from .decode.constrained import Vocabulary
from .kv.load_or_compute import CALIBRATION_TOKENS, CostModel
from .prompt.documents import SEPARATOR, check_name
from .model.forward import Forward
from .prefill.encode import ModuleEncoder
from .errors import PromptCacheError
from .kv.buffers import BufferPool
from .prompt.layout import ENCODINGS, Encoding
from .model.loading import load_model
from .model.spec import ModelSpec, inspect_model
from .paths import expand
from .kv.quantize import scheme_for
from .prefill.recovery import DEFAULT_RECOMPUTE, DEFAULT_RECOMPUTE_TAIL, Strategy, configure_recovery
from .registration import Registration
from .registry import Registry, Schema
from .kv.remote import RemoteTier
from .model.rope import RopeRotator
from .scheduler import DEFAULT_MAX_QUEUED, DEFAULT_MAX_RUNNING, DEFAULT_MAX_STEP_TOKENS, Limits, Scheduler
from .serving import Serving
from .kv.records import KVShape
from .kv.store import open_store

logger = logging.getLogger(__name__)

# shared_prefix: every module sees the schema's system prompt, as it would in full prefill, so the
# first module after it is exact and no module's first token becomes a spurious attention sink.
# scaffold: a PML schema is encoded jointly along its paths (the reference implementation's
# scaffolds): every module sees all the schema text before it; documents as with shared_prefix.
DEFAULT_ENCODING: Encoding = "shared_prefix"
DEFAULT_ASSEMBLY: Assembly = "copy"

__all__ = ["DEFAULT_ENCODING", "DEFAULT_RECOMPUTE", "DEFAULT_RECOMPUTE_TAIL", "PromptCache", "Schema"]


class PromptCache(Registration, Serving):
    """Prompt Cache over a Hugging Face causal LM.

    Build one with :meth:`from_pretrained`, register schemas with :meth:`add_schema` (or documents
    with :meth:`add_documents`), then call :meth:`generate`, :meth:`stream` or
    :meth:`generate_batch` with PML prompts (``<prompt schema="...">``) or plain text.

    Fidelity (see :mod:`pc_rag.prefill.recovery` and README "Measured quality"): ``recovery`` chooses
    which tokens of moved modules are computed again (``"head_tail"``: ``recompute`` head and
    ``recompute_tail`` tail tokens per module; ``"query"``/``"deviation"``: the
    ``recovery_budget`` best-scored, a fraction or a count); ``attention_temperature`` and
    ``attention_scale`` adjust the attention of computed queries to moved modules (APE).
    Storage: ``kv_dir`` persists module KV (``cache_dir``: its deprecated name),
    ``memory_budget`` bounds the memory tier, ``store_dtype``/``kv_location`` where and how it is held,
    ``remote_store`` (``redis://HOST:PORT/DB``, ``rediss://``, ``valkey://``) adds a tier shared by
    every replica (:mod:`pc_rag.kv.remote`): module KV and document records; ``remote_timeout_ms``
    bounds each of its commands; ``remote_sync=False`` skips taking in its documents at start (an
    encoding worker needs none); ``remote_key`` (default: the ``PC_RAG_REMOTE_KEY`` environment
    variable) authenticates every record with an HMAC (a list: the first key signs, all verify,
    for rotation); ``remote_ttl_s`` expires KV entries; ``remote_collections`` confines this
    replica to those collections of the shared registry (for Redis ACLs per tenant);
    ``remote_sync_interval_s`` is how stale this replica's view of the shared registry may get
    before a request reads it again (None: only at start, on an unknown name and on
    :meth:`sync_documents`).
    ``kv_quantization`` (``"int8"``, ``"int4"``) stores module KV in 8 or 4 bits in every tier
    (:mod:`pc_rag.kv.quantize`: keys per channel, values per token), dequantized into each request's
    buffer; a budget then holds ~3.8x (int8) or ~6.6x (int4) the modules of float32.
    Speed: ``compile=True`` runs decode steps through ``torch.compile`` (fixed shapes; compiled
    once per batch size and answer budget, so it pays off for long-lived engines with steady settings).
    Serving many callers (:mod:`pc_rag.scheduler`: one loop runs every request, batching whatever
    arrives): ``max_running`` rows decode together, ``max_step_tokens`` are prefilled per step
    while others decode, ``max_queued`` requests wait (then :class:`~pc_rag.errors.QueueFull`, at
    once or after ``queue_timeout_s``), ``buffer_budget`` bounds the bytes of KV buffers held.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        encoding: Encoding | None = None,
        kv_dir: str | os.PathLike | None = None,
        memory_budget: int | None = None,
        store_dtype: torch.dtype | None = None,
        kv_location: Literal["device", "cpu"] = "device",
        drop_in: bool = True,
        recompute: int | None = None,
        recompute_tail: int | None = None,
        assembly: Assembly | None = None,
        recovery: Strategy | None = None,
        recovery_budget: float | int | None = None,  # noqa: PYI041 - a float is a fraction, an int a count
        attention_temperature: float | None = None,
        attention_scale: float | None = None,
        cache_dir: str | os.PathLike | None = None,
        remote_store: str | None = None,
        remote_timeout_ms: float = 50.0,
        remote_sync: bool = True,
        remote_key: str | bytes | Sequence[str | bytes] | None = None,
        remote_ttl_s: float | None = None,
        remote_collections: Sequence[str] | None = None,
        remote_sync_interval_s: float | None = 1.0,
        compile: bool = False,
        kv_quantization: Literal["int8", "int4"] | None = None,
        max_running: int = DEFAULT_MAX_RUNNING,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        max_queued: int = DEFAULT_MAX_QUEUED,
        queue_timeout_s: float | None = None,
        buffer_budget: int | None = None,
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
        self.recovery = configure_recovery(self.spec, strategy=recovery, budget=recovery_budget, recompute=recompute,
                                           recompute_tail=recompute_tail, temperature=attention_temperature,
                                           scale=attention_scale)
        self.assembly: Assembly = choose_assembly(assembly, DEFAULT_ASSEMBLY, self.spec)
        kv_dtype = store_dtype or self.spec.dtype
        self.kv_quantization = kv_quantization
        scheme = scheme_for(kv_quantization)
        # every tier holds KV in kv_dtype (quantized under the scheme): part of what an entry is, so
        # of every key: quantized and full-precision entries never mix
        packing = f"|{scheme.name}" if scheme is not None else ""
        self.fingerprint = hashlib.sha256(f"{self.spec.fingerprint}|{encoding}|{kv_dtype}{packing}".encode()).hexdigest()[:32]
        kv_dir = _kv_dir(kv_dir, cache_dir)
        self.kv_dir = expand(kv_dir) if kv_dir is not None else None
        store_device = self.spec.device if kv_location == "device" else torch.device("cpu")
        # what the memory budget counts per cached token (quantized: of a 256-token module, a
        # typical document; shorter modules carry a little more of their key ranges per token)
        self._kv_bytes_per_token = (self.spec.kv_bytes_per_token(kv_dtype) if scheme is None else
                                    math.ceil(scheme.bytes_per_token(self.spec.layers, self.spec.kv_heads, self.spec.head_dim, 256)))
        if remote_sync_interval_s is not None and not remote_sync_interval_s >= 0:
            raise PromptCacheError(f"remote_sync_interval_s must be a number of seconds >= 0 or None, got {remote_sync_interval_s!r}")
        if remote_collections is not None:
            remote_collections = [check_name(c, "collection name") for c in planner.scope(remote_collections) or ()]
        self.remote = RemoteTier(remote_store, self.fingerprint, key=remote_key, timeout_ms=remote_timeout_ms,
                                 ttl_s=remote_ttl_s, announce=remote_collections is None) if remote_store else None
        self.remote_sync_interval_s = remote_sync_interval_s
        self._synced_at = time.monotonic()
        self.store = open_store(
            fingerprint=self.fingerprint, kv_dir=self.kv_dir, memory_budget=memory_budget, device=store_device,
            kv_dtype=kv_dtype, pin=store_device.type == "cpu" and self.spec.device.type == "cuda", remote=self.remote,
            shape=KVShape(self.spec.layers, self.spec.kv_heads, self.spec.head_dim, kv_dtype, scheme),
        )
        # load or recompute (pc_rag.kv.load_or_compute): rates measured from this engine's own loads and prefills
        self.costs = CostModel()
        self.store.costs = self.costs
        self.forward = Forward(model, compile=compile)
        if self.store.disk is not None or self.remote is not None:  # a prefill rate before the first load-or-compute choice
            self.costs.observe_prefill(CALIBRATION_TOKENS, self.forward.time_prefill(CALIBRATION_TOKENS))
        self.encoder = ModuleEncoder(self.forward, self.store, self.spec, encoding, self.fingerprint)
        # verbatim module texts, for drop-in reuse in plain prompts (only where modules can move)
        # (aligned through character offsets: a fast tokenizer's)
        self.drop_in = drop_in and self.spec.movable and bool(getattr(tokenizer, "is_fast", False))
        self.registry = Registry(self.spec, self.encoder, encoding=encoding, drop_in=self.drop_in, remote=self.remote,
                                 remote_collections=remote_collections)
        # documents added with background=True: encoded between requests (pc_rag.background)
        self.background = BackgroundEncoder(self.registry.add_documents)
        self.buffers = BufferPool(model)
        self.assembler = Assembler(self.spec, self.encoder, self.buffers)
        self.scheduler = Scheduler(
            spec=self.spec, buffers=self.buffers, kv_bytes_per_token=self.spec.kv_bytes_per_token(self.spec.dtype),
            limits=Limits(max_running, max_step_tokens, max_queued, queue_timeout_s, buffer_budget),
            prefill=lambda plans, new, use_cache, share: self._prefill(plans, new, use_cache, share=share),
            assemble=lambda plans, new, use_cache, share: pipeline.assemble_plain(
                plans, new, use_cache=use_cache, share=share, recovery=self.recovery, encoding=self.encoding,
                assembler=self.assembler, assembly=self.assembly, spec=self.spec),
            serving=self.background.serving, observe_prefill=self.costs.observe_prefill, forward=self.forward)
        # tokens that end an answer (EOS, end of turn); empty it for fixed-length generations
        self.stop_token_ids: set[int] = set(self.spec.stop_token_ids)
        # the model's generation defaults (do_sample, temperature, top_p, top_k, repetition_penalty,
        # ...), used where a call leaves a setting unset; replace or edit it like transformers'
        config = getattr(model, "generation_config", None)
        self.generation_config: Any = copy.deepcopy(config) if config is not None else None
        self._vocabularies: dict[frozenset[int], Vocabulary] = {}  # constrained decoding, per set of stop tokens
        if self.remote is not None and remote_sync:
            self.sync_documents()  # documents other processes stored: served here without encoding

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None, **kwargs: Any) -> PromptCache:
        """Load a model (hub id, local folder, or ``None`` for the embedded SmolLM2-135M-Instruct)
        and build the engine over it.

        Keywords of the constructor (``encoding``, ``kv_dir``, ``memory_budget``, ``recovery``,
        ``remote_store``, ``compile``, ...: see :class:`PromptCache`) configure the engine; every
        other keyword goes to transformers' ``from_pretrained`` (``revision``, ``attn_implementation``, ...).
        """
        engine_kwargs = {name: kwargs.pop(name) for name in list(kwargs) if name in _ENGINE_ARGUMENTS}
        lm, tokenizer = load_model(model, device=device, dtype=dtype, **kwargs)
        return cls(lm, tokenizer, **engine_kwargs)

    @property
    def cache_dir(self) -> Path | None:
        """Deprecated name of :attr:`kv_dir`."""
        warnings.warn("PromptCache.cache_dir is now kv_dir", DeprecationWarning, stacklevel=2)
        return self.kv_dir

    # -- recovery (see pc_rag.prefill.recovery) -----------------------------------------------------------
    @property
    def recompute(self) -> int:
        """Head tokens recomputed per moved module."""
        return self.recovery.head

    @recompute.setter
    def recompute(self, tokens: int) -> None:
        self.recovery = replace(self.recovery, head=recovery_mod.recovery_tokens(tokens, "recompute", 0, self.spec))

    @property
    def recompute_tail(self) -> int:
        """Tail tokens recomputed per moved module."""
        return self.recovery.tail

    @recompute_tail.setter
    def recompute_tail(self, tokens: int) -> None:
        self.recovery = replace(self.recovery, tail=recovery_mod.recovery_tokens(tokens, "recompute_tail", 0, self.spec))

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
        this process), ``hits_memory``, ``hits_disk``, ``hits_remote`` (read from ``remote_store``),
        ``misses`` (lookups no tier could answer), ``evictions``, ``bytes_memory``, ``bytes_disk``,
        ``tokens_memory`` (module tokens held in memory) and ``bytes_per_token`` (as stored, over them:
        ``kv_quantization`` shows here),
        ``background_pending`` (documents queued by ``add_documents(background=True)``),
        ``recomputed_tokens`` (cached tokens computed in the prompt because their tier was slower
        than prefill: :mod:`pc_rag.kv.load_or_compute`; the rates themselves: ``engine.costs.snapshot()``);
        with a remote tier, ``remote_errors`` (commands that failed: the tier was skipped) and
        ``remote_rejected`` (records and entries read back and refused)."""
        stats = {"encoded": self.forward.encoded, **self.store.stats(), "background_pending": self.background.pending,
                 "recomputed_tokens": self.costs.recomputed_tokens}
        if self.remote is not None:
            stats.update(remote_errors=self.remote.errors, remote_rejected=self.remote.rejected)
        return stats


# the constructor's keywords (from_pretrained passes these to it, the rest to transformers)
_ENGINE_ARGUMENTS = frozenset(inspect.signature(PromptCache.__init__).parameters) - {"self", "model", "tokenizer"}


def _kv_dir(kv_dir: Any, cache_dir: Any) -> Any:
    """``kv_dir``, or the deprecated ``cache_dir`` (the same folder under its old name)."""
    if cache_dir is None:
        return kv_dir
    if kv_dir is not None:
        raise PromptCacheError("give kv_dir (the module KV folder), not both kv_dir and its deprecated name cache_dir")
    warnings.warn("cache_dir= is deprecated: the module KV folder is now kv_dir= (transformers' cache_dir means the "
                  "download cache)", DeprecationWarning, stacklevel=3)
    return cache_dir
