"""``PromptCache``: the one object users hold. It wires the parts and holds no algorithm.

    prompt -> planner.plan(snapshot) -> Plan -> recovery.recover (head, tail) -> planner.admit
           -> recovery.prefill_plans: Assembler.assemble(store) [+ APE] -> generate.prefill
              [or the scored passes, pc_rag.scored] -> generate.decode -> Generation

``model.inspect_model`` measures the model once (:class:`~pc_rag.model.ModelSpec`);
``registry.Registry`` holds schemas and documents and publishes immutable snapshots;
``encoder.ModuleEncoder`` puts module KV into the ``store.ModuleStore``.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
import warnings
from collections.abc import Generator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch

from . import planner
from . import recovery as recovery_mod
from .assemble import Assembler, Assembly, choose_assembly
from .background import BackgroundEncoder
from .constrained import Vocabulary
from .documents import DEFAULT_SCHEMA, SEPARATOR, check_name, default_name, normalize
from .encoder import Forward, ModuleEncoder
from .errors import PromptCacheError
from .generate import decode
from .generation import Generation, RequestState, SamplingParams, StreamingGeneration, sampling_params
from .kvcache import BufferPool
from .layout import ENCODINGS, Encoding, Plan
from .model import ModelSpec, RopeRotator, inspect_model, load_model, render_chat
from .paths import expand
from .recovery import SCORED, Recovery, Strategy, check_ape, check_recovery
from .registry import Registry, Schema
from .remote import RemoteTier
from .rows import Prefilled
from .store import KVShape, open_store

logger = logging.getLogger(__name__)

# shared_prefix: every module sees the schema's system prompt, as it would in full prefill, so the
# first module after it is exact and no module's first token becomes a spurious attention sink.
# scaffold: a PML schema is encoded jointly along its paths (the reference implementation's
# scaffolds): every module sees all the schema text before it; documents as with shared_prefix.
DEFAULT_ENCODING: Encoding = "shared_prefix"
# Recovery: tokens recomputed at the head (EPIC-style) and at the tail of every imported module
# that was not encoded behind exactly what precedes it (benchmarks/quality.py measured the choice;
# see README)
DEFAULT_RECOMPUTE = 2
DEFAULT_RECOMPUTE_TAIL = 1
DEFAULT_RECOVERY: Strategy = "head_tail"
# APE on top (RoPE models on sdpa/eager): computed queries read moved modules through a flatter
# (temperature 1.1), lighter (scale 0.7) attention; chosen with the recovery above, see README
DEFAULT_ATTENTION_TEMPERATURE = 1.1
DEFAULT_ATTENTION_SCALE = 0.7
# (head, tail) tokens per moved module when recompute=/recompute_tail= are not given, per strategy
DEFAULT_HEAD_TAIL: dict[str, tuple[int, int]] = {"head_tail": (DEFAULT_RECOMPUTE, DEFAULT_RECOMPUTE_TAIL),
                                                 "deviation": (0, 0), "query": (0, 0)}
DEFAULT_BUDGET: dict[str, float] = {"deviation": 0.1, "query": 0.1}
DEFAULT_ASSEMBLY: Assembly = "copy"

__all__ = ["DEFAULT_ENCODING", "DEFAULT_RECOMPUTE", "DEFAULT_RECOMPUTE_TAIL", "PromptCache", "Schema"]


class PromptCache:
    """Prompt Cache over a Hugging Face causal LM.

    Build one with :meth:`from_pretrained`, register schemas with :meth:`add_schema` (or documents
    with :meth:`add_documents`), then call :meth:`generate`, :meth:`stream` or
    :meth:`generate_batch` with PML prompts (``<prompt schema="...">``) or plain text.

    Fidelity (see :mod:`pc_rag.recovery` and README "Measured quality"): ``recovery`` chooses
    which tokens of moved modules are computed again (``"head_tail"``: ``recompute`` head and
    ``recompute_tail`` tail tokens per module; ``"query"``/``"deviation"``: the
    ``recovery_budget`` best-scored, a fraction or a count); ``attention_temperature`` and
    ``attention_scale`` adjust the attention of computed queries to moved modules (APE).
    Storage: ``kv_dir`` persists module KV (``cache_dir``: its deprecated name),
    ``memory_budget`` bounds the memory tier, ``store_dtype``/``kv_location`` where and how it is held,
    ``remote_store`` shares module KV and documents between processes through Redis.
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
        strategy = recovery or DEFAULT_RECOVERY
        if recovery is None and strategy in SCORED and not self.spec.split:
            strategy = "head_tail"  # scored recovery reads attention through pc_rag_sdpa; the default falls back
        check_recovery(strategy, recovery_budget, self.spec)
        defaults = (DEFAULT_ATTENTION_TEMPERATURE, DEFAULT_ATTENTION_SCALE) if self.spec.one_pass else (1.0, 1.0)
        attention_temperature = defaults[0] if attention_temperature is None else attention_temperature
        attention_scale = defaults[1] if attention_scale is None else attention_scale
        check_ape(attention_temperature, attention_scale, self.spec)
        head_default, tail_default = DEFAULT_HEAD_TAIL[strategy]
        budget = recovery_budget if recovery_budget is not None else DEFAULT_BUDGET.get(strategy, 0)
        self.recovery = Recovery(
            strategy,  # type: ignore[arg-type]
            budget,
            recovery_mod.recovery_tokens(recompute, "recompute", head_default, self.spec),
            recovery_mod.recovery_tokens(recompute_tail, "recompute_tail", tail_default, self.spec),
            temperature=float(attention_temperature),
            scale=float(attention_scale),
        )
        self.assembly: Assembly = choose_assembly(assembly, DEFAULT_ASSEMBLY, self.spec)
        kv_dtype = store_dtype or self.spec.dtype
        # every tier holds KV in kv_dtype: it is part of what an entry is, so of every key
        self.fingerprint = hashlib.sha256(f"{self.spec.fingerprint}|{encoding}|{kv_dtype}".encode()).hexdigest()[:32]
        kv_dir = _kv_dir(kv_dir, cache_dir)
        self.kv_dir = expand(kv_dir) if kv_dir is not None else None
        store_device = self.spec.device if kv_location == "device" else torch.device("cpu")
        self._kv_bytes_per_token = self.spec.kv_bytes_per_token(kv_dtype)
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
            shape=KVShape(self.spec.layers, self.spec.kv_heads, self.spec.head_dim, kv_dtype),
        )
        self.forward = Forward(model)
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
                        dtype: torch.dtype | str | None = None, encoding: Encoding | None = None,
                        kv_dir: str | os.PathLike | None = None, memory_budget: int | None = None,
                        store_dtype: torch.dtype | None = None, kv_location: Literal["device", "cpu"] = "device",
                        drop_in: bool = True, recompute: int | None = None, recompute_tail: int | None = None,
                        assembly: Assembly | None = None, recovery: Strategy | None = None,
                        recovery_budget: float | int | None = None, attention_temperature: float | None = None,  # noqa: PYI041
                        attention_scale: float | None = None, cache_dir: str | os.PathLike | None = None,
                        remote_store: str | None = None, remote_timeout_ms: float = 50.0, remote_sync: bool = True,
                        remote_key: str | bytes | Sequence[str | bytes] | None = None, remote_ttl_s: float | None = None,
                        remote_collections: Sequence[str] | None = None, remote_sync_interval_s: float | None = 1.0,
                        **model_kwargs: Any) -> PromptCache:
        """Load a model (hub id, local folder, or ``None`` for the embedded SmolLM2-135M-Instruct).

        ``kv_dir`` persists module KV (``cache_dir`` is its deprecated old name: in transformers
        that name means the download cache, which ``from_pretrained`` here does not take).
        ``remote_store`` (``redis://HOST:PORT/DB``, ``rediss://``, ``valkey://``) adds a tier
        shared by every replica (:mod:`pc_rag.remote`): module KV and document records;
        ``remote_timeout_ms`` bounds each of its commands; ``remote_sync=False`` skips taking in
        its documents at start (an encoding worker needs none); ``remote_key`` (default: the
        ``PC_RAG_REMOTE_KEY`` environment variable) authenticates every record with an HMAC
        (a list: the first key signs, all verify, for rotation); ``remote_ttl_s`` expires KV
        entries; ``remote_collections`` confines this replica to those collections of the shared
        registry (for Redis ACLs per tenant); ``remote_sync_interval_s`` is how stale this
        replica's view of the shared registry may get before a request reads it again (None:
        only at start, on an unknown name and on :meth:`sync_documents`).
        """
        kv_dir = _kv_dir(kv_dir, cache_dir)
        lm, tokenizer = load_model(model, device=device, dtype=dtype, **model_kwargs)
        return cls(lm, tokenizer, encoding=encoding, kv_dir=kv_dir, memory_budget=memory_budget, store_dtype=store_dtype,
                   kv_location=kv_location, drop_in=drop_in, recompute=recompute, recompute_tail=recompute_tail, assembly=assembly,
                   recovery=recovery, recovery_budget=recovery_budget, attention_temperature=attention_temperature,
                   attention_scale=attention_scale, remote_store=remote_store, remote_timeout_ms=remote_timeout_ms,
                   remote_sync=remote_sync, remote_key=remote_key, remote_ttl_s=remote_ttl_s,
                   remote_collections=remote_collections, remote_sync_interval_s=remote_sync_interval_s)

    @property
    def cache_dir(self) -> Path | None:
        """Deprecated name of :attr:`kv_dir`."""
        warnings.warn("PromptCache.cache_dir is now kv_dir", DeprecationWarning, stacklevel=2)
        return self.kv_dir

    # -- recovery (see pc_rag.recovery) -----------------------------------------------------------
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
        ``background_pending`` (documents queued by ``add_documents(background=True)``);
        with a remote tier, ``remote_errors`` (commands that failed: the tier was skipped) and
        ``remote_rejected`` (records and entries read back and refused)."""
        stats = {"encoded": self.forward.encoded, **self.store.stats(), "background_pending": self.background.pending}
        if self.remote is not None:
            stats.update(remote_errors=self.remote.errors, remote_rejected=self.remote.rejected)
        return stats

    # -- registration ---------------------------------------------------------------------------
    def add_schema(self, pml: str, *, progress: bool = True) -> Schema:
        """Parse a schema and encode all its modules (loaded from ``kv_dir`` when present)."""
        return self.registry.add_schema(pml, progress=progress)

    def add_documents(self, texts: Sequence[Any], *, ids: Sequence[str] | None = None,
                      metadatas: Sequence[dict[str, Any] | None] | None = None, schema: str = DEFAULT_SCHEMA,
                      system: str | None = None, progress: bool = True, batch_tokens: int | None = None,
                      replace_changed: bool = False, background: bool = False) -> list[str]:
        """Store documents as movable modules of the document schema ``schema``; return their names.

        ``texts`` holds strings, LangChain ``Document``s or LlamaIndex nodes. A document's name is
        its id (``ids``, or the Document/node id when that is a valid module name), otherwise one
        derived from its text, so adding the same text twice stores it once. Documents are
        encoded behind the schema's system prompt (``system``; fixed when the schema is created),
        several per forward pass (up to ``batch_tokens`` padded tokens; by default 512 on CPU,
        where a 2-core machine is compute-bound at batch 1 and padding only adds work, and 8192
        on accelerators), and persisted through ``kv_dir``. A prompt places the documents it
        imports one after another, right after the system turn and the user marker, at the
        positions full prefill would give them.

        An id that already holds another text is an error, unless ``replace_changed=True``: then
        the old document is deleted (:meth:`delete_documents`) and the new text stored under the id.

        ``background=True`` returns the names at once and encodes the documents later, between
        requests (after the request being served, never during one: :mod:`pc_rag.background`).
        Until a document is encoded, a prompt reads it as text. :meth:`wait_for_documents`
        waits for the queue.
        """
        if background:
            records = normalize(texts, ids, metadatas)
            check_name(schema, "schema name")
            named = [(doc_id or default_name(text), text, meta) for doc_id, text, meta in records]
            self.background.submit(schema, system, named, replace_changed=replace_changed)
            return [name for name, _, _ in named]
        return self.registry.add_documents(texts, ids=ids, metadatas=metadatas, schema=schema, system=system,
                                           progress=progress, batch_tokens=batch_tokens, replace_changed=replace_changed)

    def wait_for_documents(self, timeout: float | None = None) -> bool:
        """Encode the documents queued by ``add_documents(background=True)`` now (still between
        requests) and wait for them; False if ``timeout`` seconds passed first."""
        return self.background.join(timeout)

    def delete_documents(self, names: str | Sequence[str], *, schema: str = DEFAULT_SCHEMA) -> list[str]:
        """Remove documents (by name, i.e. id) from collection ``schema`` everywhere they live: the
        registry and the drop-in index (no request planned from now on imports or matches them),
        memory, ``kv_dir``, the remote tier's KV and registry (other replicas drop them at their
        next sync), and every :class:`~pc_rag.retrievers.FaissModuleRetriever` bound to this
        engine. Returns the names removed; names the collection does not hold are ignored. A
        request planned before the call finishes on the KV it was planned with."""
        return self.registry.delete_documents(names, schema=schema)

    def sync_documents(self) -> int:
        """Take in the documents, deletions and PML schemas that other processes published to the
        remote tier (run at start, when a prompt names a module or schema this process does not
        know, and before a request once ``remote_sync_interval_s`` has passed); their KV stays
        remote until a prompt needs it. Returns the number of documents and schemas changed here
        (0 without a remote tier)."""
        self._synced_at = time.monotonic()
        return self.registry.sync_remote()

    def remote_backlog(self) -> int:
        """Module entries and registry records the remote tier has not taken yet (the registry's
        are sent again first): 0 means everything this engine stored is shared. An encoding job
        checks it before reporting success."""
        if self.remote is None:
            return 0
        return self.registry.flush_unpublished() + len(self.store.unshared())

    def sync_if_due(self) -> None:
        """:meth:`sync_documents` when ``remote_sync_interval_s`` has passed since the last one
        (before every request and retriever search): deletions and additions by other replicas
        reach this one within the interval. A sync another thread is running is not waited for."""
        interval = self.remote_sync_interval_s
        if self.remote is not None and interval is not None and time.monotonic() - self._synced_at >= interval:
            self._synced_at = time.monotonic()
            self.registry.sync_remote(wait=False)

    # -- serving ------------------------------------------------------------------------------------
    def plan(self, prompt: str, *, collections: str | Sequence[str] | None = None) -> Plan:
        """Which tokens of ``prompt`` are cached and which computed, at which positions.

        ``collections``: the collections (document schemas and PML schemas) this request may
        read; None (the default) is all of them, for single-user use. A scoped request imports,
        matches (drop-in) and names nothing outside them: see :func:`pc_rag.planner.plan`.
        """
        planned = planner.plan(prompt, self.registry.snapshot(), self.spec, encoding=self.encoding, drop_in=self.drop_in,
                               collections=planner.scope(collections))
        return recovery_mod.recover(planned, head=self.recovery.head, tail=self.recovery.tail, encoding=self.encoding)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """``[{"role", "content"}]`` as the model's chat template renders them, ending with the generation prompt.

        ``tools``: OpenAI-style function specs, rendered by the template when it takes tools and
        otherwise described in the system turn (see :mod:`pc_rag.tools`); assistant messages may
        carry ``tool_calls`` and ``tool`` messages the results.

        The result is a plain prompt: module references and verbatim document text inside the
        messages are reused like anywhere else; nothing in a message is read as PML.
        """
        return render_chat(self.tokenizer, self.spec.markers, messages, tools)

    def next_token_logits(self, prompt: str, *, use_cache: bool = True, collections: str | Sequence[str] | None = None) -> torch.Tensor:
        """Logits of the first generated token: the quantity cached inference must reproduce."""
        plans = self._prepare([prompt], use_cache, planner.scope(collections))
        with self.background.serving():
            prefilled = self._prefill(plans, 0, use_cache, share=False)
        self.buffers.release(prefilled.rows.buffer)
        return prefilled.logits[0]

    def generate(self, prompt: str, *, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, stop: str | Sequence[str] | None = None,
                 use_cache: bool = True, seed: int | None = None, collections: str | Sequence[str] | None = None,
                 **generation: Any) -> Generation:
        """Generate a completion; ``use_cache=False`` runs full prefill of the same token sequence.

        ``collections`` scopes the request to those collections (see :meth:`plan`; None: all).

        ``generation`` takes transformers' names, with its meaning: ``do_sample``,
        ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ``stop_strings``,
        ``output_logits``, ``generation_config`` (a ``transformers.GenerationConfig`` or a dict);
        and ``json_schema`` (a JSON schema dict, its text, or True for any JSON object): the
        output is constrained, token by token, to a document of that schema (:mod:`pc_rag.constrained`),
        closed within ``max_new_tokens`` whenever that can hold one (:meth:`min_json_tokens`), and
        not cut by stop strings. What a call leaves unset comes from ``generation_config``, then from the engine's
        :attr:`generation_config` (the model's own: its sampling defaults apply when it sets
        ``do_sample=True``), then from pc-rag's defaults (greedy, 256 new tokens). A ``temperature``
        given without ``do_sample`` decides alone: 0 is greedy, more samples.
        """
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             stop=stop, use_cache=use_cache, seed=seed, collections=collections, **generation)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str, *, max_new_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, stop: str | Sequence[str] | None = None,
               use_cache: bool = True, seed: int | None = None, collections: str | Sequence[str] | None = None,
               **generation: Any) -> StreamingGeneration:
        """Like :meth:`generate`, yielding text as it is decoded; ``.result`` holds the Generation.

        The prompt is planned (and refused, if it cannot be served) now; it is prefilled on the
        first ``next()``, on the KV it was planned with.
        """
        started = time.perf_counter()
        params = sampling_params(dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                     stop=stop, seed=seed, **generation), self.generation_config)
        plans = self._prepare([prompt], use_cache, planner.scope(collections))
        return StreamingGeneration(self._run(plans, params, use_cache, started, share=False))

    def generate_batch(self, prompts: Sequence[str], *, max_new_tokens: int | None = None, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None, stop: str | Sequence[str] | None = None,
                       use_cache: bool = True, seed: int | None = None, share_modules: bool = True,
                       collections: str | Sequence[str] | None = None, **generation: Any) -> list[Generation]:
        """Generate completions for several prompts together: one forward pass per step for all.

        Every prompt is planned first, so every error surfaces before any work. With
        ``share_modules`` (RoPE models on SDPA), cached KV that several prompts import at the same
        positions is held once and attended to once per step for all of them (shared-module
        attention, see :mod:`pc_rag.shared_attention`); what each prompt computes is prefilled in
        one batched pass. Greedy outputs equal those of :meth:`generate` called on each prompt.
        Models whose attention cannot take per-row masks (ALiBi, learned positions, flash/flex
        attention) are served one prompt after another. ``collections`` scopes every prompt
        (see :meth:`plan`); rows share only KV they may all read.
        """
        if isinstance(prompts, str):
            raise PromptCacheError("generate_batch takes a sequence of prompts; use generate() for one")
        prompts = list(prompts)
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed)
        params = sampling_params({**kwargs, **generation}, self.generation_config)  # bad arguments fail first
        scope = planner.scope(collections)
        if len(prompts) <= 1 or not self.spec.one_pass:
            return [self.generate(p, use_cache=use_cache, collections=scope, **kwargs, **generation) for p in prompts]  # type: ignore[arg-type]
        started = time.perf_counter()
        plans = self._prepare(prompts, use_cache, scope)
        run = self._run(plans, params, use_cache, started, share=share_modules and self.spec.split)
        try:
            while True:
                next(run)
        except StopIteration as done:
            return done.value

    def min_json_tokens(self, json_schema: Any) -> int | None:
        """Tokens of the shortest document of ``json_schema`` that constrained decoding closes a
        reply with (its closing walk from an empty reply: short, not always the shortest); None
        when none is within 512 tokens. A ``max_new_tokens`` below it ends incomplete."""
        from .constrained import schema_text

        closing = self._vocabulary.matcher(schema_text(json_schema)).closing()
        return None if closing is None else len(closing)

    # -- the chain -----------------------------------------------------------------------------
    @property
    def _vocabulary(self) -> Vocabulary:
        """The tokenizer indexed for constrained decoding, ending documents with today's stop tokens."""
        stops = frozenset(self.stop_token_ids)
        vocabulary = self._vocabularies.get(stops)
        if vocabulary is None:
            vocabulary = self._vocabularies[stops] = Vocabulary(self.tokenizer, self.model.config.vocab_size, stops)
        return vocabulary

    def _prepare(self, prompts: Sequence[str], use_cache: bool, collections: frozenset[str] | None = None) -> list[Plan]:
        """Plan every prompt and refuse, before any work, what cannot be served."""
        self.sync_if_due()
        plans = []
        for index, prompt in enumerate(prompts):
            try:
                try:
                    plans.append(self.plan(prompt, collections=collections))
                except PromptCacheError:
                    # a module another replica added since this one started: take the registry in, plan again
                    if self.remote is None or not self.sync_documents():
                        raise
                    plans.append(self.plan(prompt, collections=collections))
            except PromptCacheError as err:
                if len(prompts) > 1:
                    raise PromptCacheError(f"prompt {index}: {err}") from err
                raise
        planner.admit(plans, self.spec, use_cache=use_cache, memory_budget=self.store.memory_budget,
                      kv_bytes_per_token=self._kv_bytes_per_token)
        return plans

    def _prefill(self, plans: list[Plan], new_tokens: int, use_cache: bool, *, share: bool) -> Prefilled:
        return recovery_mod.prefill_plans(plans, new_tokens, use_cache=use_cache, share=share, recovery=self.recovery,
                                          encoding=self.encoding, assembler=self.assembler, assembly=self.assembly,
                                          forward=self.forward, spec=self.spec, buffers=self.buffers)

    def _run(self, plans: list[Plan], params: SamplingParams, use_cache: bool, started: float, *, share: bool
             ) -> Generator[str, None, Any]:
        """Prefill and decode ``plans`` together; yields the text of a single request as it is
        decoded, and returns its Generation (a list of them for a batch)."""
        with self.background.serving():  # documents queued for encoding wait until no request is served
            return (yield from self._serve(plans, params, use_cache, started, share=share))

    def _serve(self, plans: list[Plan], params: SamplingParams, use_cache: bool, started: float, *, share: bool
               ) -> Generator[str, None, Any]:
        spec = self.spec
        requests = [
            RequestState(params=params, tokenizer=self.tokenizer, device=spec.device, stop_token_ids=frozenset(self.stop_token_ids),
                         context_window=spec.context_window, modules=list(p.modules),
                         cached_tokens=p.cached_tokens if use_cache else 0,
                         computed_tokens=p.computed_tokens if use_cache else len(p.input_ids), next_position=p.end, started=started,
                         prompt_ids=p.input_ids if params.reads_history else (),
                         matcher=self._vocabulary.matcher(params.json_schema) if params.json_schema else None)
            for p in plans
        ]
        prefilled = self._prefill(plans, max(r.budget for r in requests), use_cache, share=share)
        rows, logits, order = prefilled.rows, prefilled.logits, prefilled.order
        requests = [requests[i] for i in order]
        for request, recomputed in zip(requests, prefilled.recomputed or [0] * len(requests)):
            request.stats.assemble_s = prefilled.assembled_at - started
            request.stats.cached_tokens -= recomputed
            request.stats.computed_tokens += recomputed
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


def _kv_dir(kv_dir: Any, cache_dir: Any) -> Any:
    """``kv_dir``, or the deprecated ``cache_dir`` (the same folder under its old name)."""
    if cache_dir is None:
        return kv_dir
    if kv_dir is not None:
        raise PromptCacheError("give kv_dir (the module KV folder), not both kv_dir and its deprecated name cache_dir")
    warnings.warn("cache_dir= is deprecated: the module KV folder is now kv_dir= (transformers' cache_dir means the "
                  "download cache)", DeprecationWarning, stacklevel=3)
    return cache_dir
