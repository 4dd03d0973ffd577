"""``PromptCache``: the one object users hold. Plan -> assemble -> prefill -> decode."""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from . import attention
from . import documents as docs_mod
from .documents import DEFAULT_SCHEMA, SEPARATOR, DocumentRecord, split_references
from .dropin import ModuleTextIndex
from .encoder import Forward
from .errors import PromptCacheError
from .generation import CacheStats, Generation, IncrementalDetokenizer, Sampler, SamplingParams, StopFilter, StreamingGeneration
from .kvcache import BufferPool, KVBuffer, ModuleKV, kv_shape
from .shared_attention import SharedKV, SharedPart, share_prefixes
from .layout import ModuleInfo, ModuleSpan, Plan, SchemaLayout, Segment, close_names, add_document, document_layout, document_module, layout_schema, plan_prompt, plan_text
from .model import PositionKind, RopeRotator, chat_markers, load_model, model_fingerprint, probe_position_kind
from .pml import is_pml_prompt, parse_prompt, parse_schema
from .store import DiskTier, ModuleStore

logger = logging.getLogger(__name__)

Encoding = Literal["isolated", "shared_prefix"]
# how a request's cached KV reaches attention: copied into its cache, or read where it is stored
Assembly = Literal["copy", "in_place"]
ENCODINGS: tuple[str, ...] = ("isolated", "shared_prefix")
# shared_prefix: every module sees the schema's system prompt, as it would in full prefill, so the
# first module after it is exact and no module's first token becomes a spurious attention sink.
DEFAULT_ENCODING: Encoding = "shared_prefix"
# Recovery: tokens recomputed at the head (EPIC-style) and at the tail of every imported module
# that was not encoded behind exactly what precedes it (benchmarks/quality.py measured the choice;
# see README)
DEFAULT_RECOMPUTE = 4
DEFAULT_RECOMPUTE_TAIL = 1
DEFAULT_ASSEMBLY: Assembly = "copy"


@dataclass
class Schema:
    """A schema the engine holds: its layout and the store key of each module's KV."""

    name: str
    source: str
    layout: SchemaLayout
    keys: dict[str, str] = field(repr=False)
    # document collections (add_documents): the records by module name, and the system prompt
    documents: dict[str, DocumentRecord] = field(default_factory=dict, repr=False)
    system: str | None = None
    # the KV of prefix + lead that documents are encoded behind (computed when first needed)
    context: ModuleKV | None = field(default=None, repr=False)

    @property
    def modules(self) -> list[str]:
        return self.layout.named_modules()

    @property
    def parameters(self) -> dict[str, dict[str, int]]:
        return {n: {p.name: p.length for p in self.layout.modules[n].params.values()} for n in self.modules}


class PromptCache:
    """Prompt Cache over a Hugging Face causal LM.

    Build one with :meth:`from_pretrained`, register schemas with :meth:`add_schema`, then call
    :meth:`generate` or :meth:`stream` with PML prompts (``<prompt schema="...">``) or plain text.
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
        attention.install(model)
        self.encoding: Encoding = encoding
        self.device = model.device
        self.dtype = model.dtype
        self.forward = Forward(model)
        self.buffers = BufferPool(model)
        layers, kv_heads, head_dim = kv_shape(model)  # fails early on models without the usual config fields
        self._heads_per_kv = model.config.get_text_config(decoder=True).num_attention_heads // kv_heads
        self.markers = chat_markers(tokenizer)
        self.position_kind: PositionKind = probe_position_kind(model, self.forward.keys_at)
        self.rotator = RopeRotator(model) if self.position_kind == "rope" else None
        # one prefill pass for all computed tokens, however many gaps they fill (see _prefill_one_pass)
        self.one_pass = self.position_kind == "rope" and attention.accepts_custom_mask(model)
        self.recompute = self._recompute_tokens(recompute, "recompute", DEFAULT_RECOMPUTE)
        self.recompute_tail = self._recompute_tokens(recompute_tail, "recompute_tail", DEFAULT_RECOMPUTE_TAIL)
        # split attention (shared_attention.py) plugs into pc_rag_sdpa: RoPE models on SDPA
        self.split = self.one_pass and getattr(model.config, "_attn_implementation", None) == attention.ATTENTION_NAME
        self.assembly: Assembly = self._assembly(assembly)
        self.forward.reset_counts()  # the probe is not module encoding
        self.placeholder_id = self._placeholder_token()
        self.separator_ids = self.tokenize(SEPARATOR)  # what follows every document's text in its module
        self.bos_ids = self._bos_ids()
        self.stop_token_ids = self._stop_token_ids()
        self.context_window = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 0) or 0) or None
        self.fingerprint = hashlib.sha256(
            f"{model_fingerprint(model, tokenizer)}|{self.dtype}|{self.position_kind}|{encoding}|{self.markers}".encode()
        ).hexdigest()[:32]
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        disk = None
        if cache_dir is not None:
            disk = DiskTier(Path(cache_dir) / "kv" / self.fingerprint, self.fingerprint)
        elif memory_budget is not None:
            # evicted modules need somewhere to go: a private spill folder for this process
            spill = tempfile.mkdtemp(prefix="pc-rag-spill-")
            atexit.register(shutil.rmtree, spill, True)
            disk = DiskTier(Path(spill), self.fingerprint)
        store_device = self.device if kv_location == "device" else torch.device("cpu")
        kv_dtype = store_dtype or self.dtype
        self._kv_bytes_per_token = layers * 2 * kv_heads * head_dim * torch.empty((), dtype=kv_dtype).element_size()
        self.store = ModuleStore(
            device=store_device,
            kv_dtype=kv_dtype,
            memory_budget=memory_budget,
            disk=disk,
            pin=store_device.type == "cpu" and self.device.type == "cuda",
        )
        self.schemas: dict[str, Schema] = {}
        # verbatim module texts, for drop-in reuse in plain prompts (only where modules can move)
        self.drop_in = drop_in and self.movable
        self.text_index = ModuleTextIndex()
        self._lock = threading.RLock()

    # -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        encoding: Encoding | None = None,
        cache_dir: str | os.PathLike | None = None,
        memory_budget: int | None = None,
        store_dtype: torch.dtype | None = None,
        kv_location: Literal["device", "cpu"] = "device",
        drop_in: bool = True,
        recompute: int | None = None,
        recompute_tail: int | None = None,
        assembly: Assembly | None = None,
        **model_kwargs: Any,
    ) -> "PromptCache":
        """Load a model (hub id, local folder, or ``None`` for the embedded SmolLM2-135M-Instruct)."""
        lm, tokenizer = load_model(model, device=device, dtype=dtype, **model_kwargs)
        return cls(
            lm,
            tokenizer,
            encoding=encoding,
            cache_dir=cache_dir,
            memory_budget=memory_budget,
            store_dtype=store_dtype,
            kv_location=kv_location,
            drop_in=drop_in,
            recompute=recompute,
            recompute_tail=recompute_tail,
            assembly=assembly,
        )

    def _recompute_tokens(self, requested: int | None, what: str, default: int) -> int:
        """How many head (tail) tokens of each imported module to recompute (see :meth:`_recover`)."""
        supported = self.one_pass
        if requested is None:
            return default if supported else 0
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
            raise PromptCacheError(f"{what} must be a number of tokens >= 0, got {requested!r}")
        if requested and not supported:
            raise PromptCacheError(
                f"{what} needs a RoPE model on sdpa or eager attention; this one has {self.position_kind} positions "
                f"and {getattr(self.model.config, '_attn_implementation', None)!r} attention (use {what}=0)"
            )
        return requested

    def _assembly(self, requested: Assembly | None) -> Assembly:
        """``in_place`` (zero-copy: modules are attended to where they are stored) needs split attention."""
        if requested is None:
            return DEFAULT_ASSEMBLY if self.split else "copy"
        if requested not in ("copy", "in_place"):
            raise PromptCacheError(f"assembly must be 'copy' or 'in_place', got {requested!r}")
        if requested == "in_place" and not self.split:
            raise PromptCacheError(
                "assembly='in_place' needs a RoPE model on sdpa attention; this one has "
                f"{self.position_kind} positions and {getattr(self.model.config, '_attn_implementation', None)!r} attention"
            )
        return requested

    @property
    def movable(self) -> bool:
        """Whether cached modules can be placed at positions other than those they were encoded at."""
        return self.position_kind in ("rope", "alibi")

    # -----------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _placeholder_token(self) -> int:
        for attr in ("unk_token_id", "pad_token_id", "eos_token_id"):
            value = getattr(self.tokenizer, attr, None)
            if isinstance(value, int):
                return value
        return 0

    def _bos_ids(self) -> list[int]:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        with_special = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        return [bos] if bos is not None and with_special and with_special[0] == bos else []

    @property
    def _bos_text(self) -> str | None:
        return getattr(self.tokenizer, "bos_token", None) if self.bos_ids else None

    def _stop_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.config, getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        # the end-of-turn marker of the chat template ends an answer too (e.g. <|im_end|>)
        end = self.tokenize(self.markers.ends["assistant"].strip())
        if len(end) == 1:
            ids.add(end[0])
        return ids

    # -----------------------------------------------------------------------------------------
    def add_schema(self, pml: str, *, progress: bool = True) -> Schema:
        """Parse a schema and encode all its modules (loaded from ``cache_dir`` when present)."""
        doc = parse_schema(pml)
        with self._lock:
            existing = self.schemas.get(doc.name)
            if existing is not None and existing.source == pml:
                return existing
            if existing is not None and existing.layout.documents:
                raise PromptCacheError(f"schema {doc.name!r} is a document collection (add_documents); choose another name")
            layout = layout_schema(doc, self.tokenize, self.markers, self.placeholder_id, self.bos_ids)
            self._check_window(layout.length, f"schema {doc.name!r}")
            prefix = layout.prefix if self.encoding == "shared_prefix" else None
            keys: dict[str, str] = {}
            prefix_kv: ModuleKV | None = None
            if prefix is not None:
                keys[prefix] = self._entry_key(layout.modules[prefix], None)
                prefix_kv = self._ensure(layout, prefix, keys[prefix], None)
            # shared_prefix computes the always-included text after the prefix at serve time (see plan_prompt)
            shared = self.encoding == "shared_prefix"
            todo = [name for name, info in layout.modules.items() if name != prefix and not (shared and info.anonymous)]
            for name in todo:
                keys[name] = self._entry_key(layout.modules[name], keys.get(prefix) if prefix else None)
            missing = [n for n in todo if keys[n] not in self.store]
            bar = tqdm(missing, desc=f"encoding {doc.name}", unit="module", disable=not progress or not missing, leave=False)
            for name in todo:
                if name in missing:
                    bar.update(1)
                self._ensure(layout, name, keys[name], prefix_kv)
            bar.close()
            schema = Schema(doc.name, pml, layout, keys)
            self.schemas[doc.name] = schema
            self.text_index.remove_schema(doc.name)
            if self.drop_in:
                for name, info in layout.modules.items():
                    if info.text is not None and not info.anonymous:
                        self.text_index.add(doc.name, name, info.text)
            logger.info("schema %r: %d modules, %d tokens, %d encoded", doc.name, len(schema.modules), layout.length, len(missing))
            return schema

    def _entry_key(self, info: ModuleInfo, prefix_key: str | None) -> str:
        h = hashlib.sha256()
        h.update(f"{self.fingerprint}|{self.encoding}|{prefix_key}|".encode())
        h.update(torch.tensor(info.token_ids, dtype=torch.int64).numpy().tobytes())
        h.update(torch.tensor(info.positions, dtype=torch.int64).numpy().tobytes())
        return h.hexdigest()

    def _ensure(self, layout: SchemaLayout, name: str, key: str, prefix: ModuleKV | None) -> ModuleKV:
        module = self.store.get(key)
        if module is None:
            info = layout.modules[name]
            module = self.forward.encode(info.token_ids, info.positions, prefix)
            module = self.store.put(key, module, {"schema": layout.name, "module": name, "tokens": len(info.token_ids)})
        return module

    def _check_budget(self, plan: Plan) -> None:
        """Refuse, before any work, a request whose imported module KV alone exceeds the memory budget."""
        budget = self.store.memory_budget
        if budget is None:
            return
        needed = plan.cached_tokens * self._kv_bytes_per_token
        if needed > budget:
            raise PromptCacheError(
                f"the prompt imports {plan.cached_tokens} cached tokens ({needed:,} bytes of KV), "
                f"more than memory_budget ({budget:,} bytes); raise the budget or import fewer modules"
            )

    def _check_window(self, length: int, what: str) -> None:
        if self.context_window is not None and length > self.context_window:
            raise PromptCacheError(f"{what} needs {length} positions, more than the model's context window ({self.context_window})")

    # -----------------------------------------------------------------------------------------
    def add_documents(
        self,
        texts: Sequence[Any],
        *,
        ids: Sequence[str] | None = None,
        metadatas: Sequence[dict[str, Any] | None] | None = None,
        schema: str = DEFAULT_SCHEMA,
        system: str | None = None,
        progress: bool = True,
        batch_tokens: int | None = None,
    ) -> list[str]:
        """Store documents as movable modules of the document schema ``schema``; return their names.

        ``texts`` holds strings, LangChain ``Document``s or LlamaIndex nodes. A document's name is
        its id (``ids``, or the Document/node id when that is a valid module name), otherwise one
        derived from its text, so adding the same text twice stores it once. Documents are
        encoded behind the schema's system prompt (``system``; fixed when the schema is created),
        several per forward pass (up to ``batch_tokens`` padded tokens; by default 512 on CPU,
        where a 2-core machine is compute-bound at batch 1 and padding only adds work, and 8192
        on accelerators), and persisted through
        ``cache_dir``. A prompt places the documents it imports one after another, right after
        the system turn and the user marker, at the positions full prefill would give them.
        """
        records = docs_mod.normalize(texts, ids, metadatas)
        if not self.movable:
            raise PromptCacheError(
                "documents are movable modules, and this model uses learned absolute positions, which cannot move; "
                "declare the documents in a PML schema (add_schema) instead"
            )
        docs_mod.check_name(schema, "schema name")
        with self._lock:
            target = self._document_schema(schema, system)
            layout = target.layout
            separator = self.separator_ids
            names: list[str] = []
            fresh: dict[str, tuple[str, list[int], dict[str, Any]]] = {}
            for doc_id, text, meta in records:  # validate everything before changing anything
                name = doc_id or docs_mod.default_name(text)
                known = target.documents.get(name)
                held = known.text if known is not None else fresh[name][0] if name in fresh else None
                if held is not None and held != text:
                    raise PromptCacheError(f"document id {name!r} already holds a different text in schema {schema!r}")
                if held is None:
                    text_ids = self.tokenize(text)
                    self._check_window(layout.document_start + len(text_ids) + len(separator), f"document {name!r}")
                    fresh[name] = (text, text_ids, meta)
                names.append(name)
            prefix_key = None
            if self.encoding == "shared_prefix" and layout.prefix:
                prefix_key = f"{target.keys[layout.prefix]}+{layout.lead}"
            built = {name: document_module(layout, name, text, text_ids, separator) for name, (text, text_ids, _) in fresh.items()}
            keys = {name: self._entry_key(info, prefix_key) for name, info in built.items()}
            if batch_tokens is None:
                batch_tokens = 512 if self.device.type == "cpu" else 8192
            # encode first, publish after: a prompt served meanwhile on another thread never sees a
            # document whose KV is not stored yet (it would encode it a second time)
            self._encode_documents(target, [(keys[n], built[n]) for n in built], progress, batch_tokens)
            for name, info in built.items():
                target.keys[name] = keys[name]
                target.documents[name] = DocumentRecord(name, fresh[name][0], fresh[name][2])
                add_document(layout, info)
                if self.drop_in:
                    self.text_index.add(schema, name, info.text or "")
            logger.info("documents %r: %d added (%d new), %d held", schema, len(names), len(fresh), len(target.documents))
            return names

    def _document_schema(self, name: str, system: str | None) -> Schema:
        existing = self.schemas.get(name)
        if existing is not None:
            if not existing.layout.documents:
                raise PromptCacheError(f"schema {name!r} is a PML schema; put documents in a schema of their own")
            if system is not None and system != existing.system:
                raise PromptCacheError(
                    f"documents schema {name!r} was created with system prompt {existing.system!r}; "
                    "its documents are encoded behind it, so a different one needs another schema name"
                )
            return existing
        system = docs_mod.DEFAULT_SYSTEM if system is None else system
        turn = self.markers.starts["system"] + system + self.markers.ends["system"] if system else ""
        # the user marker: a prompt's documents follow it, so they are encoded behind it too
        layout = document_layout(name, self.bos_ids + self.tokenize(turn), self.tokenize(self.markers.starts["user"]))
        schema = Schema(name, f"<documents system={system!r}>", layout, {}, {}, system)
        if layout.prefix is not None:
            schema.keys[layout.prefix] = self._entry_key(layout.modules[layout.prefix], None)
            self._ensure(layout, layout.prefix, schema.keys[layout.prefix], None)
            if self.drop_in and turn and not self.bos_ids:
                # a chat prompt that opens with this very system turn reuses its KV too (position 0: exact)
                info = layout.modules[layout.prefix]
                info.text, info.text_tokens = turn, len(info.token_ids)
                self.text_index.add(name, layout.prefix, turn)
        self.schemas[name] = schema
        return schema

    def _encode_documents(self, schema: Schema, modules: list[tuple[str, ModuleInfo]], progress: bool, batch_tokens: int) -> None:
        """Encode the documents whose KV the store lacks, longest first, several per forward pass."""
        layout = schema.layout
        todo: dict[str, ModuleInfo] = {}  # key -> module: two names with one text share one entry
        for key, info in modules:
            if key not in todo and key not in self.store:
                todo[key] = info
        if not todo:
            return
        context = self._encoding_context(schema)
        queue = sorted(todo.items(), key=lambda item: -len(item[1].token_ids))
        bar = tqdm(total=len(queue), desc=f"encoding {schema.name}", unit="doc", disable=not progress, leave=False)
        while queue:
            width = len(queue[0][1].token_ids)
            take = max(1, min(len(queue), batch_tokens // max(width, 1)))
            batch, queue = queue[:take], queue[take:]
            encoded = self.forward.encode_batch(
                [info.token_ids for _, info in batch], layout.document_start, context, pad_id=self.placeholder_id
            )
            for (key, info), module in zip(batch, encoded):
                self.store.put(key, module, {"schema": schema.name, "module": info.name, "tokens": len(module)})
            bar.update(len(batch))
        bar.close()

    # -----------------------------------------------------------------------------------------
    def plan(self, prompt: str) -> Plan:
        """Which tokens of ``prompt`` are cached and which computed, at which positions."""
        if not isinstance(prompt, str):
            raise PromptCacheError(f"prompt must be a str, got {type(prompt).__name__}")
        plan = self._plan_plain(prompt) if not is_pml_prompt(prompt) else self._plan_pml(prompt)
        return self._recover(plan) if self.recompute or self.recompute_tail else plan

    def _plan_pml(self, prompt: str) -> Plan:
        doc = parse_prompt(prompt)
        schema = self.schemas.get(doc.schema)
        if schema is None:
            known = ", ".join(sorted(self.schemas)) or "none; call add_schema() first"
            raise PromptCacheError(f"unknown schema {doc.schema!r} (schemas: {known})", line=doc.line, column=doc.column)
        return plan_prompt(
            schema.layout, doc, self.tokenize, self.markers, compact=self.movable, cache_anonymous=self.encoding == "isolated"
        )

    def _recover(self, plan: Plan) -> Plan:
        """Compute the first ``recompute`` and the last ``recompute_tail`` tokens of every imported
        module instead of reusing them.

        A module encoded on its own never attended to the modules placed before it in this
        prompt. Its first tokens carry much of that loss (they also soak up attention as the start
        of a sequence): recomputing them behind everything that precedes them (EPIC,
        arXiv:2410.15332) restores cross-module attention for a few tokens per module. Its last
        token (for a document, the separator) has, in full prefill, read every module before it;
        encoded alone it read one. Recomputed, it carries the whole context to the tokens after
        it (on HotpotQA one tail token per document cut the first-token KL divergence from full
        prefill by a third, see README). The tail is the end of the stored module: a document
        quoted into plain text ends with its text, and the separator after it is computed anyway.
        Exact already, and left alone: the schema's prefix, and under ``shared_prefix`` encoding a
        module at the position it was encoded at behind exactly the tokens it was encoded behind
        (the first document of a ``build_prompt`` or chat prompt, after the system turn and the
        user marker).
        """
        segments: list[Segment] = []
        for segment in plan.segments:
            if not segment.cached:
                segments.append(segment)
                continue
            schema = self.schemas[segment.schema or plan.schema]  # type: ignore[index]
            exact = segment.owner == schema.layout.prefix or (
                # rare (a module where it was encoded): only then compare what precedes it
                segment.position == segment.source_position
                and [t for s in segments for t in s.token_ids] == self._context_ids(schema)
            )
            if exact:
                segments.append(segment)
                continue
            module_end = segment.offset + len(segment) == len(schema.layout.modules[segment.owner].token_ids)  # type: ignore[index]
            head = 0 if segment.offset else min(self.recompute, len(segment))
            tail = min(self.recompute_tail, len(segment) - head) if module_end else 0
            kept = len(segment) - head - tail
            if head:
                segments.append(Segment(segment.token_ids[:head], segment.position))
            if kept:
                segments.append(
                    replace(segment, token_ids=segment.token_ids[head : head + kept], position=segment.position + head,
                            offset=segment.offset + head, source_position=segment.source_position + head)
                )
            if tail:
                segments.append(Segment(segment.token_ids[head + kept :], segment.position + head + kept))
        return replace(plan, segments=segments)

    def _context_ids(self, schema: Schema) -> list[int] | None:
        """The tokens a module of ``schema`` was encoded behind (see :meth:`_encoding_context`)."""
        layout = schema.layout
        if self.encoding != "shared_prefix" or layout.prefix is None:
            return None  # isolated: only the prefix itself, at position 0, is exact
        return layout.modules[layout.prefix].token_ids + layout.lead

    def _plan_plain(self, prompt: str) -> Plan:
        """Plain text: honour module references, reuse the KV of known module text found verbatim."""
        bos_text = self._bos_text
        bos = [] if bos_text and prompt.startswith(bos_text) else self.bos_ids  # a chat template may render BOS itself
        items: list[str | ModuleSpan] = []
        for piece in split_references(prompt):
            if isinstance(piece, ModuleSpan):
                items.append(self._referenced(piece))
                continue
            cursor = 0
            if self.drop_in:
                for match in self.text_index.find(piece):
                    info = self.schemas[match.schema].layout.modules[match.name]
                    items.append(piece[cursor : match.start])
                    items.append(ModuleSpan(match.schema, match.name, info.text_tokens))
                    cursor = match.end
            items.append(piece[cursor:])
        layouts = {name: s.layout for name, s in list(self.schemas.items())}  # a snapshot: add_schema may run meanwhile
        return plan_text(items, layouts, self.tokenize, bos)

    def _referenced(self, ref: ModuleSpan) -> ModuleSpan:
        schema = self.schemas.get(ref.schema)
        if schema is None:
            raise PromptCacheError(f"module reference to unknown schema {ref.schema!r} (schemas: {', '.join(sorted(self.schemas)) or 'none'})")
        info = schema.layout.modules.get(ref.name)
        if info is None or info.anonymous:
            raise PromptCacheError(
                f"module reference to unknown module {ref.name!r} in schema {ref.schema!r}; {close_names(ref.name, schema.layout.named_modules())}"
            )
        if info.text is None:
            raise PromptCacheError(f"module {ref.name!r} has parameters or nested modules: import it with a PML prompt")
        if not self.movable:
            raise PromptCacheError(f"module {ref.name!r} cannot move on a model with learned absolute positions")
        return ModuleSpan(ref.schema, ref.name, info.text_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """``[{"role", "content"}]`` as the model's chat template renders them, ending with the generation prompt.

        The result is a plain prompt: module references and verbatim document text inside the
        messages are reused like anywhere else; nothing in a message is read as PML.
        """
        rendered: list[dict[str, str]] = []
        for index, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise PromptCacheError(f"message {index} needs a str 'role' and a str 'content', got {message!r:.120}")
            rendered.append({"role": role, "content": content})
        if not rendered:
            raise PromptCacheError("no messages to render")
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        parts = []
        for m in rendered:
            start, end = self.markers.wrap(m["role"] if m["role"] in self.markers.starts else "user")
            parts.append(start + m["content"] + end)
        return "".join(parts) + self.markers.generation

    def next_token_logits(self, prompt: str, *, use_cache: bool = True) -> torch.Tensor:
        """Logits of the first generated token: the quantity cached inference must reproduce."""
        plan = self.plan(prompt)
        self._check_window(max(plan.position_ids) + 1, "the prompt")
        buffer, _, logits, _ = self._prefill(plan, 0, use_cache)
        self.buffers.release(buffer)
        return logits

    def generate(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop: str | Sequence[str] | None = None,
        use_cache: bool = True,
        seed: int | None = None,
    ) -> Generation:
        """Generate a completion; ``use_cache=False`` runs full prefill of the same token sequence."""
        stream = self.stream(
            prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, use_cache=use_cache, seed=seed
        )
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop: str | Sequence[str] | None = None,
        use_cache: bool = True,
        seed: int | None = None,
    ) -> StreamingGeneration:
        """Like :meth:`generate`, yielding text as it is decoded; ``.result`` holds the Generation."""
        started = time.perf_counter()
        params = SamplingParams.build(max_new_tokens, temperature, top_p, top_k, stop, seed)
        plan, end = self._prepare(prompt, use_cache, "the prompt")  # errors surface here, before iterating
        return StreamingGeneration(self._decode(plan, end, params, use_cache, started))

    def _prepare(self, prompt: str, use_cache: bool, what: str) -> tuple[Plan, int]:
        """Plan ``prompt`` and refuse it before any work if it cannot be served; returns the plan
        and the position after its last token."""
        plan = self.plan(prompt)
        end = max(plan.position_ids) + 1  # the property builds a list: read it once
        self._check_window(end, what)
        if use_cache:
            self._check_budget(plan)
        return plan, end

    # -----------------------------------------------------------------------------------------
    def _prefill(
        self, plan: Plan, new_tokens: int, use_cache: bool, assembly: Assembly | None = None
    ) -> tuple[KVBuffer, SharedKV | None, torch.Tensor, float]:
        """Prefill ``plan`` into a buffer with room for ``new_tokens`` more; return the buffer, the
        KV attended to in place (in-place assembly) or None, the last token's logits and the
        assembly time."""
        if not use_cache:
            buffer = self.buffers.acquire(len(plan.input_ids) + new_tokens)
            return buffer, None, self.forward(buffer, plan.input_ids, plan.position_ids, logits=True), 0.0
        if (assembly or self.assembly) == "in_place":
            return self._prefill_in_place(plan, new_tokens)
        buffer = self.buffers.acquire(len(plan.input_ids) + new_tokens)
        if self.one_pass:
            return self._prefill_one_pass(plan, buffer)
        assemble_s = 0.0
        logits: torch.Tensor | None = None
        ids: list[int] = []
        positions: list[int] = []
        last = len(plan.segments) - 1
        for index, segment in enumerate(plan.segments):
            if not segment.cached:
                ids.extend(segment.token_ids)
                positions.extend(range(segment.position, segment.position + len(segment)))
                if index == last or plan.segments[index + 1].cached:
                    logits = self.forward(buffer, ids, positions, logits=index == last)
                    ids, positions = [], []
                continue
            t0 = time.perf_counter()
            self._append_cached(buffer, plan, segment)
            assemble_s += time.perf_counter() - t0
        assert logits is not None  # plan_prompt guarantees the last segment is computed
        return buffer, None, logits, assemble_s

    def _prefill_one_pass(self, plan: Plan, buffer: KVBuffer) -> tuple[KVBuffer, None, torch.Tensor, float]:
        """All cached segments first, then every computed token in one forward pass.

        The computed tokens (recomputed module heads, text between modules, the question) sit
        after all cached KV in the buffer, out of position order, so causality is given by
        positions instead of buffer order: a token sees every entry whose position is not after
        its own. That is the same computation as running them in order, in one pass instead of
        one per gap (on CPU each pass costs a full read of the weights; a drop-in prompt quoting
        50 documents has 50 gaps). RoPE only: keys carry their positions, so buffer order does
        not matter to them; ALiBi and learned positions read buffer order.
        """
        t0 = time.perf_counter()
        kv_positions: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        for segment in plan.segments:
            span = range(segment.position, segment.position + len(segment))
            if segment.cached:
                self._append_cached(buffer, plan, segment)
                kv_positions.extend(span)
            else:
                ids.extend(segment.token_ids)
                positions.extend(span)
        assemble_s = time.perf_counter() - t0
        query = torch.tensor(positions, device=self.device)
        keys = torch.cat([torch.tensor(kv_positions, dtype=torch.long, device=self.device), query])
        mask = attention.position_mask(query, keys, self.model)
        # plan_prompt guarantees the last segment is computed: the pass's last token is the prompt's
        return buffer, None, self.forward(buffer, ids, positions, logits=True, mask=mask), assemble_s

    def _prefill_in_place(self, plan: Plan, new_tokens: int) -> tuple[KVBuffer, SharedKV, torch.Tensor, float]:
        """Zero-copy assembly: every cached segment is attended to where the store keeps it.

        The request's own buffer receives only the computed tokens (in position order, so the
        usual causal mask holds among them); moved modules are read unrotated, their queries
        rotated back instead (see :mod:`pc_rag.shared_attention`).
        """
        t0 = time.perf_counter()
        parts: list[SharedPart] = []
        ids: list[int] = []
        positions: list[int] = []
        for segment in plan.segments:
            if segment.cached:
                kv, shift = self._segment_kv(plan, segment)
                parts.append(SharedPart(kv.to(self.device, self.dtype), self._positions(segment), slice(0, 1), shift))
            else:
                ids.extend(segment.token_ids)
                positions.extend(range(segment.position, segment.position + len(segment)))
        shared = self._shared_kv(parts)
        buffer = self.buffers.acquire(len(ids) + new_tokens)
        assemble_s = time.perf_counter() - t0
        return buffer, shared, self.forward(buffer, ids, positions, logits=True, shared=shared), assemble_s

    def _shared_kv(self, parts: list[SharedPart]) -> SharedKV:
        return SharedKV(parts, heads_per_kv=self._heads_per_kv, dtype=self.dtype, rotator=self.rotator)

    def _positions(self, segment: Segment) -> torch.Tensor:
        return torch.arange(segment.position, segment.position + len(segment), device=self.device)

    def _segment_kv(self, plan: Plan, segment: Segment) -> tuple[torch.Tensor, int]:
        """A cached segment's stored KV ``[layers, 2, heads, n, dim]`` (a view) and how far it moved."""
        schema = self.schemas[segment.schema or plan.schema]  # type: ignore[index]
        module = self.store.get(schema.keys[segment.owner])  # type: ignore[index]
        if module is None:
            # evicted and not on disk (or its disk entry was invalid): encode it again
            module = self._reencode(schema, segment.owner)  # type: ignore[arg-type]
        kv = module.kv[:, :, :, segment.offset : segment.offset + len(segment)]
        delta = segment.position - segment.source_position
        if delta and self.position_kind == "learned":
            raise PromptCacheError(f"module {segment.owner!r} cannot move on a model with learned absolute positions")
        # ALiBi keys carry no position: a moved module's KV is used as it is
        return kv, delta if self.rotator is not None else 0

    def _rotation(self, delta: int) -> Any:
        """The ``rotate`` argument of :meth:`KVBuffer.write` for a module moved by ``delta``."""
        if not delta:
            return None
        rotator = self.rotator
        return lambda out, keys: rotator.rotate_into(out, keys, delta)

    def _append_cached(self, buffer: KVBuffer, plan: Plan, segment: Segment) -> None:
        """Copy one cached segment's KV into ``buffer``, rotated to its position when it moved."""
        kv, delta = self._segment_kv(plan, segment)
        buffer.append(kv, rotate=self._rotation(delta))

    def _reencode(self, schema: Schema, name: str) -> ModuleKV:
        with self._lock:  # two requests missing the same module encode it once (_ensure looks again)
            return self._reencode_locked(schema, name)

    def _reencode_locked(self, schema: Schema, name: str) -> ModuleKV:
        context = self._encoding_context(schema) if name != schema.layout.prefix else None
        return self._ensure(schema.layout, name, schema.keys[name], context)

    def _encoding_context(self, schema: Schema) -> ModuleKV | None:
        """What the modules of ``schema`` are encoded behind: nothing (``isolated``), else its
        prefix, and for documents the lead after it (computed once per process: a few tokens)."""
        layout = schema.layout
        if self.encoding != "shared_prefix" or layout.prefix is None:
            return None
        prefix = self._ensure(layout, layout.prefix, schema.keys[layout.prefix], None)
        if not layout.lead:
            return prefix
        if schema.context is None:
            total = layout.document_start
            buffer = KVBuffer.for_model(self.model, total)
            buffer.append(prefix.kv)
            self.forward(buffer, layout.lead, range(layout.prefix_length, total), logits=False)
            schema.context = ModuleKV(buffer.slice(0, total).clone(), torch.arange(total))
        return schema.context

    def _decode(
        self, plan: Plan, next_position: int, params: SamplingParams, use_cache: bool, started: float
    ) -> Generator[str, None, Generation]:
        request = _Request(self, plan, params, use_cache, started, next_position)
        buffer, shared, logits, assemble_s = self._prefill(plan, request.budget, use_cache)
        request.stats.assemble_s = (request.prefill_started - started) + assemble_s
        while not request.done:
            token, delta = request.take(logits)
            if delta:
                yield delta
            if token is not None:
                logits = self.forward(buffer, [token], [request.next_position], logits=True, shared=shared)
                request.next_position += 1
        self.buffers.release(buffer)
        tail, result = request.close()
        if tail:
            yield tail
        return result

    # -----------------------------------------------------------------------------------------
    def generate_batch(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop: str | Sequence[str] | None = None,
        use_cache: bool = True,
        seed: int | None = None,
        share_modules: bool = True,
    ) -> list[Generation]:
        """Generate completions for several prompts together: one forward pass per step for all.

        Every prompt is planned first, so every error surfaces before any work. With
        ``share_modules`` (RoPE models on SDPA), cached KV that several prompts import at the same
        positions is held once and attended to once per step for all of them (shared-module
        attention, see :mod:`pc_rag.shared_attention`); what each prompt computes is prefilled in
        one batched pass. Otherwise each prompt is prefilled on its own and the batch decodes
        with a copy of every request's cache (naive batching). Greedy outputs equal those of
        :meth:`generate` called on each prompt. Models whose attention cannot take per-row masks
        (ALiBi, learned positions, flash/flex attention) are served one prompt after another.
        """
        if isinstance(prompts, str):
            raise PromptCacheError("generate_batch takes a sequence of prompts; use generate() for one")
        prompts = list(prompts)
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed)
        if len(prompts) <= 1 or not self.one_pass:
            return [self.generate(p, use_cache=use_cache, **kwargs) for p in prompts]  # type: ignore[arg-type]
        started = time.perf_counter()
        params = SamplingParams.build(max_new_tokens, temperature, top_p, top_k, stop, seed)
        prepared = [self._prepare(p, use_cache, f"prompt {index}") for index, p in enumerate(prompts)]
        if share_modules and use_cache and self.split:
            return self._generate_shared(prepared, params, started)
        requests: list[_Request] = []
        caches: list[KVBuffer] = []
        tokens: list[int | None] = []
        for plan, end in prepared:
            request = _Request(self, plan, params, use_cache, started, end)
            cache, _, logits, assemble_s = self._prefill(plan, 0, use_cache, assembly="copy")
            request.stats.assemble_s = (request.prefill_started - started) + assemble_s
            token = None
            if not request.done:
                token, _ = request.take(logits)
            requests.append(request)
            caches.append(cache)
            tokens.append(token)
        width = max(len(c) for c in caches)
        steps = max(r.budget for r in requests)
        batch = KVBuffer.for_model(self.model, width + steps, batch=len(requests))
        batch.storage.zero_()  # padding is masked, but 0 x NaN garbage would still be NaN
        valid = torch.zeros(len(requests), width + steps, dtype=torch.bool, device=self.device)
        for row, cache in enumerate(caches):
            batch.storage[:, :, row, :, : len(cache)].copy_(cache.storage[:, :, 0, :, : len(cache)])
            valid[row, : len(cache)] = True
            self.buffers.release(cache)
        batch.grow_to(width)
        self._decode_rows(batch, requests, tokens, valid, width)
        return [request.close()[1] for request in requests]

    def _decode_rows(
        self, buffer: KVBuffer, requests: list[_Request], tokens: list[int | None], valid: torch.Tensor, column: int,
        shared: SharedKV | None = None,
    ) -> None:
        """Decode a batch until every row is done; ``valid`` marks each row's real entries (its
        first ``column`` columns are filled), ``tokens`` the first token each row feeds."""
        while any(token is not None for token in tokens):
            valid[:, column] = True  # this step's keys (rows already finished attend to junk nobody reads)
            column += 1
            mask = attention.row_mask(valid[:, :column], self.model)
            ids = [t if t is not None else self.placeholder_id for t in tokens]
            logits = self.forward.decode_batch(buffer, ids, [r.next_position for r in requests], mask, shared)
            for row, request in enumerate(requests):
                request.next_position += 1
                if tokens[row] is not None:
                    tokens[row], _ = request.take(logits[row])


    def _generate_shared(self, prepared: list[tuple[Plan, int]], params: SamplingParams, started: float) -> list[Generation]:
        """``generate_batch`` with shared-module attention.

        Rows are sorted by their cached segments, so that prompts importing the same modules at
        the same positions are adjacent; :func:`share_prefixes` finds the runs two or more rows
        share (ChunkAttention's prefix tree). A run is held once: read in place when it is one
        stored module, else assembled once for the whole batch. Each row's own cache receives
        what it shares with nobody, then its computed tokens, left-padded so that one batched
        pass ends on every row's last prompt token; masks follow positions, as in
        :meth:`_prefill_one_pass`.
        """
        plans = [plan for plan, _ in prepared]
        cached = [[s for s in plan.segments if s.cached] for plan in plans]
        signatures = [tuple(self._signature(plan, s) for s in segments) for plan, segments in zip(plans, cached)]
        order = sorted(range(len(plans)), key=lambda i: signatures[i])
        runs, private_from = share_prefixes([signatures[i] for i in order])
        requests = [_Request(self, plans[i], params, True, started, prepared[i][1]) for i in order]
        t0 = time.perf_counter()
        parts = [self._shared_part(plans[order[run.rows.start]], cached[order[run.rows.start]][run.first : run.stop], run.rows) for run in runs]
        own = [cached[i][private_from[row] :] for row, i in enumerate(order)]
        computed = [[s for s in plans[i].segments if not s.cached] for i in order]
        own_width = max(sum(len(s) for s in segments) for segments in own)
        width = max(sum(len(s) for s in segments) for segments in computed)
        end = own_width + width
        capacity = end + max(r.budget for r in requests)
        rows = len(order)
        buffer = KVBuffer.for_model(self.model, capacity, batch=rows)
        # masked entries still meet the values in a product (weight 0 x value): uninitialised
        # memory can hold NaN, and 0 x NaN is NaN
        buffer.storage.zero_()
        valid = torch.zeros(rows, capacity, dtype=torch.bool)
        key_positions = torch.zeros(rows, capacity, dtype=torch.long)
        ids = torch.full((rows, width), self.placeholder_id, dtype=torch.long)
        positions = torch.zeros(rows, width, dtype=torch.long)
        for row, (segments, computing) in enumerate(zip(own, computed)):
            at = 0
            for segment in segments:
                kv, delta = self._segment_kv(plans[order[row]], segment)
                buffer.write(kv, at, row=row, rotate=self._rotation(delta))
                key_positions[row, at : at + len(segment)] = torch.arange(segment.position, segment.position + len(segment))
                valid[row, at : at + len(segment)] = True
                at += len(segment)
            row_ids = [t for s in computing for t in s.token_ids]
            row_positions = [p for s in computing for p in range(s.position, s.position + len(s))]
            pad = width - len(row_ids)
            ids[row, pad:] = torch.tensor(row_ids)
            positions[row, pad:] = torch.tensor(row_positions)
            positions[row, :pad] = row_positions[0]  # padding queries see what the row's first token sees: no NaN
            valid[row, own_width + pad : end] = True
        key_positions[:, own_width:end] = positions
        buffer.grow_to(own_width)
        shared = self._shared_kv(parts)
        valid, key_positions, positions = valid.to(self.device), key_positions.to(self.device), positions.to(self.device)
        assemble_s = time.perf_counter() - t0
        allowed = valid[:, None, :end] & (key_positions[:, None, :end] <= positions[:, :, None])
        logits = self.forward.prefill_batch(buffer, ids, positions, allowed[:, None], shared)
        tokens: list[int | None] = []
        for row, request in enumerate(requests):
            request.stats.assemble_s = (request.prefill_started - started) + assemble_s
            tokens.append(request.take(logits[row])[0] if not request.done else None)
        self._decode_rows(buffer, requests, tokens, valid, end, shared)
        results: list[Generation | None] = [None] * rows
        for row, i in enumerate(order):
            results[i] = requests[row].close()[1]
        return results  # type: ignore[return-value]

    def _signature(self, plan: Plan, segment: Segment) -> tuple[str, int, int, int, int]:
        """What makes two cached segments the same KV: entry, offset, length, position, encoded position."""
        schema = self.schemas[segment.schema or plan.schema]  # type: ignore[index]
        return (schema.keys[segment.owner], segment.offset, len(segment), segment.position, segment.source_position)  # type: ignore[index]

    def _shared_part(self, plan: Plan, segments: list[Segment], rows: slice) -> SharedPart:
        """One shared run: the stored KV read in place when it is one segment, else assembled once."""
        if len(segments) == 1:
            kv, shift = self._segment_kv(plan, segments[0])
            return SharedPart(kv.to(self.device, self.dtype), self._positions(segments[0]), rows, shift)
        run = KVBuffer.for_model(self.model, sum(len(s) for s in segments))
        for segment in segments:
            kv, delta = self._segment_kv(plan, segment)
            run.append(kv, rotate=self._rotation(delta))
        positions = torch.cat([self._positions(s) for s in segments])
        return SharedPart(run.slice(0, len(run)), positions, rows)


class _Request:
    """One request's decoding state: sampling, detokenising, stop handling and statistics."""

    def __init__(self, engine: PromptCache, plan: Plan, params: SamplingParams, use_cache: bool, started: float, next_position: int) -> None:
        self.stop_token_ids = engine.stop_token_ids
        self.started = started
        self.next_position = next_position
        self.budget = params.max_new_tokens
        if engine.context_window is not None:
            self.budget = min(self.budget, engine.context_window - next_position)
        self.stats = CacheStats(modules=list(plan.modules))
        if use_cache:
            self.stats.cached_tokens, self.stats.computed_tokens = plan.cached_tokens, plan.computed_tokens
        else:
            self.stats.computed_tokens = len(plan.input_ids)
        self.sampler = Sampler(params, engine.device)
        self.detok = IncrementalDetokenizer(engine.tokenizer)
        self.stops = StopFilter(params.stop)
        self.pieces: list[str] = []
        self.finish = "length"
        self.steps = 0
        self.done = self.budget <= 0
        self.prefill_started = time.perf_counter()  # built right before its prefill

    def take(self, logits: torch.Tensor) -> tuple[int | None, str]:
        """Sample from ``logits``; return the token to feed next (None once done) and the new text."""
        token = self.sampler(logits)
        if self.steps == 0:
            now = time.perf_counter()
            self.stats.ttft_s = now - self.started
            self.stats.prefill_s = now - self.prefill_started
        self.steps += 1
        if token in self.stop_token_ids:
            self.finish, self.done = "stop", True
            return None, ""
        self.stats.generated_tokens += 1
        delta = self.stops.feed(self.detok.add(token))
        if delta:
            self.pieces.append(delta)
        if self.stops.stopped:
            self.finish, self.done = "stop", True
        elif self.steps >= self.budget:
            self.done = True
        return (None if self.done else token), delta

    def close(self) -> tuple[str, Generation]:
        """The text still held back (flushed now) and the finished Generation."""
        tail = ""
        if not self.stops.stopped:
            tail = self.stops.feed(self.detok.finish()) + self.stops.flush()
            if tail:
                self.pieces.append(tail)
        self.stats.total_s = time.perf_counter() - self.started
        return tail, Generation("".join(self.pieces), self.stats, list(self.detok.tokens), self.finish)
