"""``PromptCache``: the one object users hold. It wires the parts and holds no algorithm.

    prompt -> planner.plan(snapshot) -> Plan -> prefill.recovery.recover -> planner.admit
           -> Scheduler.submit ... [its loop] prefill.pipeline.prefill_plans (assemble, recover, prefill)
              -> decode.loop.RunningBatch (with other callers' rows) -> Generation

The public API's halves live in :mod:`pc_rag.registration` (schemas, documents, the shared
registry) and :mod:`pc_rag.serving` (the request above); :mod:`pc_rag.engine_parts` opens the KV
tiers; this module builds the rest. docs/architecture.md draws the whole.
"""

from __future__ import annotations

import copy
import inspect
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch

from . import planner
from .admission import DEFAULT_MAX_QUEUED, DEFAULT_MAX_RUNNING, DEFAULT_MAX_STEP_TOKENS, Limits
from .background import BackgroundEncoder
from .decode.constrained import Vocabulary
from .engine_parts import open_kv, with_kv_dtype
from .errors import PromptCacheError
from .forward.forward import Forward, compile_mode
from .forward.rotation import RopeRotator
from .forward.turns import DEFAULT_ENCODE_SHARE, ModelTurns
from .kv.buffers import BufferPool
from .kv.load_or_compute import CALIBRATION_TOKENS, CostModel
from .model.loading import gguf_file_of, load_model
from .model.spec import ModelSpec, inspect_model
from .prefill import calibration
from .prefill.assemble import Assembler, Assembly, choose_assembly
from .prefill.encode import ModuleEncoder
from .prefill.recovery import DEFAULT_RECOMPUTE, DEFAULT_RECOMPUTE_TAIL, Strategy, recovery_tokens
from .prompt.documents import SEPARATOR, check_name
from .prompt.layout import ENCODINGS, Encoding
from .prompt.recurring import recurring_passages
from .registration import Registration
from .registry import Registry
from .registry_snapshot import Schema
from .registry_sync import RegistrySync
from .scheduler import Scheduler
from .serving import Serving
from .weights import choice as model_weights
from .weights import small_batch

# shared_prefix: every module sees the schema's system prompt, as in full prefill (no first token becomes a
# spurious attention sink); scaffold: a PML schema encoded jointly along its paths, as the reference implementation does
DEFAULT_ENCODING: Encoding = "shared_prefix"
DEFAULT_ASSEMBLY: Assembly = "copy"

__all__ = ["DEFAULT_ENCODING", "DEFAULT_RECOMPUTE", "DEFAULT_RECOMPUTE_TAIL", "PromptCache", "Schema"]


class PromptCache(Registration, Serving):
    """Prompt Cache over a Hugging Face causal LM.

    Build one with :meth:`from_pretrained`, register schemas with :meth:`add_schema` (or documents with :meth:`add_documents`),
    then call :meth:`generate`, :meth:`stream` or :meth:`generate_batch` with PML prompts (``<prompt schema="...">``) or plain text.

    Args:
        model: a transformers causal LM (:meth:`from_pretrained` loads one).
        tokenizer: its tokenizer.
        encoding: what modules are encoded behind: ``"shared_prefix"`` (the schema's system prompt; default), ``"isolated"``
            (nothing) or ``"scaffold"`` (a PML schema's text along its paths).
        drop_in: find stored modules' verbatim text inside plain prompts and reuse their KV.

    Fidelity (:mod:`pc_rag.prefill.recovery`, docs/quality.md):
        recovery: which tokens of moved modules are computed again: ``"head_tail"`` (default),
            ``"query"`` or ``"deviation"`` (the best-scored ``recovery_budget``).
        recovery_budget: for the scored strategies, a fraction (float) or a count (int) of tokens.
        recompute: head tokens recomputed per moved module (``"head_tail"``).
        recompute_tail: tail tokens recomputed per moved module. These four None: as ``check()`` recorded for this model in
            ``kv_dir`` (:mod:`pc_rag.prefill.calibration`), else the defaults.
        attention_temperature, attention_scale: APE's temperature and scale of computed queries' attention to moved modules.
        assembly: ``"copy"`` (default) or ``"in_place"`` (modules attended to where they are stored).

    Storage (:mod:`pc_rag.kv.store`):
        kv_dir: a folder that persists module KV across processes.
        memory_budget: bytes of module KV the memory tier holds (LRU; evicted to ``kv_dir``).
        kv_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: requests' KV buffers (default: the model's dtype).
        store_dtype: the dtype module KV is held in (default: ``kv_dtype``).
        kv_location: ``"device"`` (default) or ``"cpu"`` (pinned host memory on a GPU).
        kv_quantization: ``"int8"`` or ``"int4"``: module KV in 8 or 4 bits in every tier (:mod:`pc_rag.kv.quantize`: ~3.8x, ~6.6x).

    Remote tier shared by replicas (:mod:`pc_rag.kv.remote`, docs/scaling.md):
        remote_store: ``redis://HOST:PORT/DB``, ``rediss://`` or ``valkey://``: module KV and document records.
        remote_timeout_ms: the bound on each of its commands (past it the tier is skipped).
        remote_sync: take in the shared documents at start (False for an encoding worker).
        remote_key: signs and verifies every record (HMAC; default ``PC_RAG_REMOTE_KEY``; a list rotates: the first signs, all verify).
        remote_ttl_s: expiry of KV entries.
        remote_collections: confine this replica to these collections (Redis ACLs per tenant).
        remote_sync_interval_s: how stale this replica's view of the shared registry may get before
            a request reads it again (None: only at start, on an unknown name and on :meth:`sync_documents`).

    Serving many callers (:mod:`pc_rag.scheduler`: one loop runs every request):
        max_running: rows decoding together.
        max_step_tokens: tokens prefilled per step while the others decode.
        max_queued: requests waiting; past it :class:`~pc_rag.errors.QueueFull`.
        queue_timeout_s: wait up to this long for a queue place instead of failing at once.
        buffer_budget: bytes of KV buffers held at once (running and admitted rows', the pool's idle ones: let go first).
        fuse_prefill: a request admitted while others decode is prefilled in chunks that share a forward pass
            with their decode step where it runs as tensor ops (the C step runs after the chunk; False: always between steps).
        compile: run decode steps through ``torch.compile``: True (mode "default") or a mode by name; ``"reduce-overhead"``
            replays each step as a CUDA graph on a GPU (on a CPU it compiles as "default"). Batched rows copy the module KV they
            import alike (a step over shared parts runs eagerly). Call :meth:`warm_up` first, or the first callers compile.
        small_batch_linear: linear layers compute inputs of 2-16 rows (decode steps of several requests) as
            ``W @ x^T``, streaming the weights once on a CPU (:mod:`pc_rag.weights.small_batch`). None: for a float32
            CPU model with over 32 MB of linear weights. Set on the model's layers (for every user of that model object).
        weights: a CPU model's linear layers in ``"float16"`` (float32 arithmetic), ``"int4"`` (the LM head in 8 bits) or ``"int4-a8"``
            (decode steps' inputs in 8 bits too); None: as loaded (the model is changed: :mod:`pc_rag.weights.choice`; embedded: int4).
        weights_from: the GGUF file ``model`` was read from: ``"int4"`` holds its own blocks (:mod:`pc_rag.weights.gguf_blocks`).
        encode_share: the share of the model's time that documents queued with ``background=True`` take while requests run.
        learn_passages: a passage computed by this many prompts of one scope becomes its document (:mod:`pc_rag.prompt.recurring`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        encoding: Encoding | None = None,
        drop_in: bool = True,
        recovery: Strategy | None = None,
        recovery_budget: float | int | None = None,  # noqa: PYI041 - a float is a fraction, an int a count
        recompute: int | None = None,
        recompute_tail: int | None = None,
        attention_temperature: float | None = None,
        attention_scale: float | None = None,
        assembly: Assembly | None = None,
        kv_dir: str | os.PathLike | None = None, memory_budget: int | None = None,
        kv_dtype: torch.dtype | Literal["float32", "bfloat16", "float16"] | None = None,
        store_dtype: torch.dtype | None = None,
        kv_location: Literal["device", "cpu"] = "device",
        kv_quantization: Literal["int8", "int4"] | None = None,
        remote_store: str | None = None,
        remote_timeout_ms: float = 50.0, remote_sync: bool = True,
        remote_key: str | bytes | Sequence[str | bytes] | None = None,
        remote_ttl_s: float | None = None,
        remote_collections: Sequence[str] | None = None,
        remote_sync_interval_s: float | None = 1.0,
        max_running: int = DEFAULT_MAX_RUNNING,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        max_queued: int = DEFAULT_MAX_QUEUED,
        queue_timeout_s: float | None = None,
        buffer_budget: int | None = None,
        fuse_prefill: bool = True,
        compile: bool | str = False,
        small_batch_linear: bool | None = None,
        encode_share: float = DEFAULT_ENCODE_SHARE,
        weights: Literal["float32", "float16", "int4", "int4-a8"] | None = None, weights_from: str | os.PathLike | None = None,
        learn_passages: int | None = None,
    ) -> None:
        self.encoding: Encoding = _checked(encoding or DEFAULT_ENCODING, memory_budget, kv_location, remote_sync_interval_s)
        turns = ModelTurns(encode_share)  # background encoding's share of the model while requests run (refused if not a share)
        self.model, self.tokenizer = model, tokenizer
        self.weights, self.quantized_layers = weights or "float32", model_weights.install(model, weights, compile_mode(compile) is not None, weights_from)
        self.small_batch_linear = small_batch.install(model, small_batch_linear)
        self.spec: ModelSpec = with_kv_dtype(inspect_model(model, tokenizer, separator=SEPARATOR), kv_dtype)
        asked = dict(recovery=recovery, recovery_budget=recovery_budget, recompute=recompute, recompute_tail=recompute_tail)
        self.recovery = calibration.recovery(self.spec, kv_dir, asked=asked, temperature=attention_temperature, scale=attention_scale)
        self.assembly: Assembly = choose_assembly(assembly, DEFAULT_ASSEMBLY, self.spec)
        self.kv_quantization = kv_quantization
        if remote_collections is not None:
            remote_collections = [check_name(c, "collection name") for c in planner.scope(remote_collections) or ()]
        tiers = open_kv(self.spec, encoding=self.encoding, kv_dir=kv_dir, memory_budget=memory_budget, store_dtype=store_dtype,
                        kv_location=kv_location, kv_quantization=kv_quantization, remote_store=remote_store, remote_key=remote_key,
                        remote_timeout_ms=remote_timeout_ms, remote_ttl_s=remote_ttl_s, remote_collections=remote_collections)
        self.fingerprint, self.kv_dir, self.remote, self.store = tiers.fingerprint, tiers.kv_dir, tiers.remote, tiers.store
        self._kv_bytes_per_token = tiers.bytes_per_token
        self.remote_sync_interval_s, self._synced_at = remote_sync_interval_s, time.monotonic()
        self._build(drop_in=drop_in, compile=compile, remote_collections=remote_collections, turns=turns,
                    limits=Limits(max_running, max_step_tokens, max_queued, queue_timeout_s, buffer_budget, fuse_prefill))
        self.passages = recurring_passages(learn_passages, self.spec, self.tokenizer, self.drop_in)
        if self.remote is not None and remote_sync:
            self.sync_documents()  # documents other processes stored: served here without encoding

    def _build(self, *, drop_in: bool, compile: bool | str, remote_collections: Sequence[str] | None, limits: Limits, turns: ModelTurns) -> None:
        """The parts over the model and the KV tiers, lowest first."""
        model = self.model
        # load or recompute (pc_rag.kv.load_or_compute): rates measured from this engine's own loads and prefills
        self.costs = self.store.costs = CostModel()
        self.forward = Forward(model, compile=compile, turns=turns, written=True, kv_dtype=self.spec.kv_dtype)
        if self.store.disk is not None or self.remote is not None:  # a prefill rate before the first load-or-compute choice
            self.costs.observe_prefill(CALIBRATION_TOKENS, self.forward.time_prefill(CALIBRATION_TOKENS))
        self.encoder = ModuleEncoder(self.forward, self.store, self.spec, self.encoding, self.fingerprint)
        # drop-in needs modules that can move, and a fast tokenizer's character offsets to align text
        self.drop_in = drop_in and self.spec.movable and bool(getattr(self.tokenizer, "is_fast", False))
        self.registry = Registry(self.spec, self.encoder, encoding=self.encoding, drop_in=self.drop_in)
        # the registry shared with other replicas through the remote tier: this one's changes out, theirs in
        self.registry_sync = RegistrySync(self.registry, self.remote, remote_collections) if self.remote is not None else None
        self.registry.publisher = self.registry_sync
        self.background = BackgroundEncoder(self._add_records, delete=self.registry.delete_documents, turns=turns, remote=self.remote)
        self.buffers = BufferPool(model, dtype=self.spec.kv_dtype)
        self.assembler = Assembler(self.spec, self.encoder, self.buffers)
        self.scheduler = self._scheduler(limits)
        self.stop_token_ids: set[int] = set(self.spec.stop_token_ids)  # EOS, end of turn; empty it for fixed-length generations
        # the model's generation defaults, used where a call leaves a setting unset; edit it like transformers'
        self.generation_config: Any = copy.deepcopy(getattr(model, "generation_config", None))
        self._vocabularies: dict[frozenset[int], Vocabulary] = {}  # constrained decoding, per set of stop tokens

    def _scheduler(self, limits: Limits) -> Scheduler:
        """The loop that runs every request: it prefills through this engine's prefill path."""
        return Scheduler(spec=self.spec, buffers=self.buffers, kv_bytes_per_token=self.spec.kv_bytes_per_token(),
                         limits=limits, prefill=self._prefill, assemble=self._assemble_plain, serving=self.background.serving,
                         observe_prefill=self.costs.observe_prefill, forward=self.forward)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None, **kwargs: Any) -> PromptCache:
        """Load a model (hub id, local folder, a GGUF file, or ``None`` for the embedded SmolLM2-135M-Instruct)
        and build the engine over it.

        Keywords of the constructor (``encoding``, ``kv_dir``, ``memory_budget``, ``recovery``,
        ``remote_store``, ``compile``, ...: see :class:`PromptCache`) configure the engine; every
        other keyword goes to transformers' ``from_pretrained`` (``revision``, ``attn_implementation``,
        ``cache_dir`` (the download cache), ...).
        """
        engine_kwargs = {name: kwargs.pop(name) for name in list(kwargs) if name in _ENGINE_ARGUMENTS}
        lm, tokenizer = load_model(model, device=device, dtype=dtype, **kwargs)
        gguf = engine_kwargs.setdefault("weights_from", gguf_file_of(model, kwargs.get("gguf_file"), kwargs.get("revision")))
        engine_kwargs["weights"] = model_weights.chosen(engine_kwargs.get("weights"), from_gguf=model is None or gguf is not None, dtype=dtype,
                                                        device=device, compile=engine_kwargs.get("compile", False))
        return cls(lm, tokenizer, **engine_kwargs)

    # -- recovery (see pc_rag.prefill.recovery) -------------------------------------------------
    @property
    def recompute(self) -> int:
        """Head tokens recomputed per moved module."""
        return self.recovery.head

    @recompute.setter
    def recompute(self, tokens: int) -> None:
        self.recovery = replace(self.recovery, head=recovery_tokens(tokens, "recompute", 0, self.spec))

    @property
    def recompute_tail(self) -> int:
        """Tail tokens recomputed per moved module."""
        return self.recovery.tail

    @recompute_tail.setter
    def recompute_tail(self, tokens: int) -> None:
        self.recovery = replace(self.recovery, tail=recovery_tokens(tokens, "recompute_tail", 0, self.spec))

    # -- facts about the model (see ModelSpec) --------------------------------------------------
    position_kind = property(lambda self: self.spec.position_kind, doc="How the model encodes positions (measured).")
    movable = property(lambda self: self.spec.movable, doc="Whether cached modules can be placed at other positions than encoded at.")
    rotator: RopeRotator | None = property(lambda self: self.spec.rotator)  # type: ignore[assignment]
    split = property(lambda self: self.spec.split, doc="Whether attention reads shared KV in place (split attention).")
    markers = property(lambda self: self.spec.markers, doc="The chat template's role markers.")
    device: torch.device = property(lambda self: self.spec.device)  # type: ignore[assignment]
    dtype: torch.dtype = property(lambda self: self.spec.dtype)  # type: ignore[assignment]
    context_window: int | None = property(lambda self: self.spec.context_window)  # type: ignore[assignment]
    separator_ids = property(lambda self: list(self.spec.separator_ids), doc="The tokens between documents.")

    @property
    def schemas(self) -> Mapping[str, Schema]:
        """The schemas registered now (a read-only snapshot)."""
        return self.registry.snapshot().schemas

    def tokenize(self, text: str) -> list[int]:
        return self.spec.tokenize(text)

    def store_stats(self) -> dict[str, int]:
        """Where module KV came from since this engine started: ``encoded`` (modules encoded by this process),
        ``hits_memory``, ``hits_disk``, ``hits_remote`` (read from ``remote_store``), ``misses`` (lookups no tier could
        answer), ``evictions``, ``bytes_memory``, ``bytes_disk``, ``tokens_memory`` (module tokens held in memory) and
        ``bytes_per_token`` (as stored, over them: ``kv_quantization`` shows here), ``background_pending`` (documents
        queued by ``add_documents(background=True)``), ``recomputed_tokens`` (cached tokens computed in the prompt because
        their tier was slower than prefill: :mod:`pc_rag.kv.load_or_compute`; the rates: ``engine.costs.snapshot()``),
        ``passages_learned`` (``learn_passages``); with a remote tier, ``remote_errors`` (commands that failed: the tier
        was skipped) and ``remote_rejected`` (records and entries read back and refused)."""
        stats = {"encoded": self.forward.encoded, **self.store.stats(), "background_pending": self.background.pending,
                 "recomputed_tokens": self.costs.recomputed_tokens, "passages_learned": self.passages.learned if self.passages else 0}
        if self.remote is not None:
            stats.update(remote_errors=self.remote.errors, remote_rejected=self.remote.rejected)
        return stats


# the constructor's keywords (from_pretrained passes these to it, the rest to transformers)
_ENGINE_ARGUMENTS = frozenset(inspect.signature(PromptCache.__init__).parameters) - {"self", "model", "tokenizer"}


def _checked(encoding: Any, memory_budget: Any, kv_location: Any, remote_sync_interval_s: Any) -> Encoding:
    """The options checked before any work (a typed error naming the option); the encoding."""
    if encoding not in ENCODINGS:
        raise PromptCacheError(f"unknown encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
    if memory_budget is not None and memory_budget < 0:
        raise PromptCacheError(f"memory_budget must be a number of bytes >= 0, got {memory_budget!r}")
    if kv_location not in ("device", "cpu"):
        raise PromptCacheError(f"kv_location must be 'device' or 'cpu', got {kv_location!r}")
    if remote_sync_interval_s is not None and not remote_sync_interval_s >= 0:
        raise PromptCacheError(f"remote_sync_interval_s must be a number of seconds >= 0 or None, got {remote_sync_interval_s!r}")
    return encoding
