"""Module encoding: module text -> per-layer K/V at its positions, under a key, into the store."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import forks
from ..forward.forward import Forward
from ..kv.buffers import KVBuffer, ModuleKV


# ---------------------------------------------------------------------------------------------
# Module encoding: what goes into the store, under which key, behind which context
# ---------------------------------------------------------------------------------------------
def entry_key(fingerprint: str, encoding: str, collection: str, token_ids: Sequence[int], positions: Sequence[int],
              context_key: str | None) -> str:
    """The store key of a module's KV, ``<collection>/<sha-256>``: the hash covers the engine, the
    encoding, the collection, what the module was encoded behind, its tokens and positions.

    The collection is part of it so that the same text in two collections is two entries: a hit
    in one says nothing about the other (no timing side channel between tenants), and every tier
    can keep, list and delete a collection's entries apart (disk folders, Redis key prefixes).
    """
    h = hashlib.sha256()
    h.update(f"{fingerprint}|{encoding}|{collection}|{context_key}|".encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(np.asarray(positions, dtype=np.int64).tobytes())
    return f"{collection}/{h.hexdigest()}"


class ModuleEncoder:
    """Encodes modules into the store, each once: the KV of a module's tokens at its positions,
    behind its schema's encoding context (nothing for ``isolated``; the schema's prefix, and for
    documents the lead after it, for ``shared_prefix``).

    Registration (:mod:`pc_rag.registry`) encodes through it before it publishes a module, and
    assembly reads through :meth:`fetch`, which encodes again what the store lost (evicted with
    no disk tier, or a disk entry that failed verification). One lock serialises encoding, so
    two requests missing the same module encode it once.
    """

    def __init__(self, forward: Forward, store: Any, spec: Any, encoding: str, fingerprint: str) -> None:
        self.forward = forward
        self.store = store
        self.spec = spec
        self.encoding = encoding
        self.fingerprint = fingerprint
        self._contexts: dict[str, ModuleKV] = {}  # prefix + lead KV of document schemas, by key
        self._lock = threading.RLock()
        self._late: set[Future] = set()  # reads prefetch left running past a deadline
        self._late_lock = threading.Lock()
        forks.renew_after_fork(self, "_lock", "_late_lock")

    def key(self, collection: str, token_ids: Sequence[int], positions: Sequence[int], context_key: str | None) -> str:
        return entry_key(self.fingerprint, self.encoding, collection, token_ids, positions, context_key)

    def ensure(self, key: str, token_ids: Sequence[int], positions: Sequence[int], context: ModuleKV | None, info: dict[str, Any],
               *, count: bool = True) -> ModuleKV:
        """The stored KV under ``key``, encoded now if the store does not hold it (``count``: this
        lookup counts in the store's statistics; False when the caller has looked already)."""
        module = self.store.get(key, positions, count=count)
        if module is not None:
            return module
        with self._lock:
            module = self.store.get(key, positions, count=False)  # another thread may have encoded it meanwhile
            if module is None:
                module = self.forward.encode(token_ids, positions, context)
                module = self.store.put(key, module, info)
            return module

    def context(self, schema: Any) -> ModuleKV | None:
        """What the modules of ``schema`` are encoded behind (see class docstring)."""
        layout = schema.layout
        if self.encoding == "isolated" or layout.prefix is None:
            return None
        prefix_info = layout.modules[layout.prefix]
        prefix = self.ensure(schema.keys[layout.prefix], prefix_info.token_ids, prefix_info.positions, None, _info(schema, layout.prefix))
        if not layout.lead:
            return prefix
        # the prefix and the lead: a few tokens, computed once per process and kept here
        total = layout.document_start
        key = self.key(schema.name, list(prefix_info.token_ids) + list(layout.lead), range(total), schema.keys[layout.prefix])
        module = self._contexts.get(key)
        if module is None:
            with self._lock:
                module = self._contexts.get(key)
                if module is None:
                    buffer = KVBuffer.for_model(self.forward.model, total, dtype=self.forward.kv_dtype)
                    buffer.append(prefix.read(dtype=buffer.storage.dtype))
                    self.forward(buffer, layout.lead, range(layout.prefix_length, total), logits=False)
                    module = ModuleKV(buffer.slice(0, total).clone(), torch.arange(total))
                    self._contexts[key] = module
        return module

    def fetch(self, schema: Any, name: str, key: str, *, plain: bool = False) -> ModuleKV:
        """A planned segment's KV: from the store, or encoded again from the schema the plan pinned
        (``plain``: a document's plain variant, behind the system turn and not its neighbours)."""
        info = schema.layout.modules[name]
        positions = stored_positions(schema, name, plain)
        module = self.store.get(key, positions)
        if module is not None:
            return module
        if plain:
            return self.ensure(key, info.token_ids, positions, self.context(schema), _info(schema, name), count=False)
        if name in schema.joint:
            return self._encode_joint(schema, name, key)
        if name in schema.contexts:
            with self._lock:
                module = self.store.get(key, info.positions, count=False)
                if module is None:
                    self._encode_in_context(schema, [(key, info)], 0)
                    module = self.store.get(key, info.positions, count=False)
                if module is None:  # stored nowhere that keeps it (a budget smaller than the module)
                    raise RuntimeError(f"module {name!r} was encoded but the store does not hold it")
                return module
        context = self.context(schema) if name != schema.layout.prefix else None
        return self.ensure(key, info.token_ids, info.positions, context, _info(schema, name), count=False)

    def prefetch(self, plans: Sequence[Any], keys: Sequence[str], deadline: float | None = None) -> set[str]:
        """Read the modules under ``keys`` (imported by ``plans``) from disk or the remote tier into
        memory, concurrently: their reads (sockets, files, checksums) overlap instead of queueing
        one behind another in assembly. A module that turns out missing or invalid is left to
        :meth:`fetch`, which encodes it.

        With ``deadline`` (seconds), the keys whose reads have not finished by then are returned
        (the caller computes those segments instead) and their reads go on into memory, for
        later requests (:meth:`settle` waits for them)."""
        wanted = set(keys)
        jobs: dict[str, Sequence[int]] = {}
        for plan in plans:
            for segment in plan.segments:
                if segment.cached and segment.key in wanted and segment.key not in jobs:
                    jobs[segment.key] = stored_positions(plan.sources[segment.schema], segment.owner, segment.plain)
        if deadline is None and len(jobs) == 1:
            ((key, positions),) = jobs.items()
            self.store.get(key, positions, count=False)
            return set()
        if not jobs:
            return set()
        reads = {key: _readers().submit(self.store.get, key, positions, count=False) for key, positions in jobs.items()}
        done, late = futures_wait(reads.values(), timeout=deadline)
        for read in done:
            read.result()  # an error reading is raised here, as before the deadline existed
        if late:
            with self._late_lock:
                self._late.update(late)
        return {key for key, read in reads.items() if read in late}

    def settle(self, timeout: float | None = None) -> bool:
        """Wait for the reads :meth:`prefetch` left running past a deadline; True when none is left."""
        with self._late_lock:
            late, self._late = set(self._late), set()
        _, left = futures_wait(late, timeout=timeout)
        with self._late_lock:
            self._late.update(left)
        return not left

    def _encode_joint(self, schema: Any, name: str, key: str) -> ModuleKV:
        """Encode the path ``name`` lies on in one forward pass (``encoding="scaffold"``): every
        module of the path is stored, each the slice of the path's KV at its own tokens."""
        path = schema.joint[name].token_ids
        with self._lock:
            module = self.store.get(key, schema.joint[name].module_positions, count=False)
            if module is not None:
                return module
            joint = schema.joint[name]
            whole = self.forward.encode(joint.token_ids, joint.positions)
            found = None
            for member, placement in schema.joint.items():
                if placement.token_ids is not path:
                    continue
                index = torch.tensor(placement.index, dtype=torch.long, device=whole.kv.device)
                stored = self.store.put(schema.keys[member], ModuleKV(whole.kv.index_select(3, index), torch.tensor(placement.module_positions)),
                                        _info(schema, member))
                if member == name:
                    found = stored
            assert found is not None
            return found

    def encode_documents(self, schema: Any, modules: Sequence[tuple[str, Any]], *, progress: bool, batch_tokens: int,
                         contexts: Mapping[str, Any] | None = None) -> None:
        """Encode the documents whose KV the store lacks, longest first, several per forward pass;
        a document with a neighbour context (``contexts``, by name) behind it."""
        todo: dict[str, Any] = {}  # key -> module: two names with one text share one entry
        for key, info in modules:
            todo.setdefault(key, info)
        # one look for all of them (the remote tier: one pipelined round trip, not one per document)
        for key, held in zip(list(todo), self.store.contains_many(list(todo))):
            if held:
                del todo[key]
        if not todo:
            return
        with self._lock:
            self._encode_in_context(schema, list(todo.items()), batch_tokens, contexts, progress=progress)

    def _encode_in_context(self, schema: Any, todo: list[tuple[str, Any]], batch_tokens: int, contexts: Mapping[str, Any] | None = None,
                           *, progress: bool = False) -> None:
        """Encode documents ``(key, module)`` behind the prefix and lead, each behind its neighbour
        context (``contexts``, else the schema's) too; only their own KV is stored."""
        contexts = schema.contexts if contexts is None else contexts
        behind = {key: tuple(contexts[info.name].token_ids) if info.name in contexts else () for key, info in todo}
        context = self.context(schema)
        queue = sorted(todo, key=lambda item: -(len(behind[item[0]]) + len(item[1].token_ids)))
        bar = tqdm(total=len(queue), desc=f"encoding {schema.name}", unit="doc", disable=not progress, leave=False)
        while queue:
            width = len(behind[queue[0][0]]) + len(queue[0][1].token_ids)
            take = max(1, min(len(queue), batch_tokens // max(width, 1)))
            batch, queue = queue[:take], queue[take:]
            started = time.perf_counter()
            encoded = self.forward.encode_batch(
                [behind[key] + tuple(info.token_ids) for key, info in batch], schema.layout.document_start, context,
                pad_id=self.spec.placeholder_id, keep_from=[len(behind[key]) for key, _ in batch],
            )
            costs = self.store.costs
            if costs is not None:  # a prefill rate before the first request (pc_rag.kv.load_or_compute)
                if encoded[0].kv.device.type == "cuda":
                    torch.cuda.synchronize(encoded[0].kv.device)
                costs.observe_prefill(sum(len(behind[key]) + len(m) for (key, _), m in zip(batch, encoded)), time.perf_counter() - started)
            for (key, info), module in zip(batch, encoded):
                self.store.put(key, module, {"schema": schema.name, "module": info.name, "tokens": len(module)})
            bar.update(len(batch))
        bar.close()


def stored_positions(schema: Any, name: str, plain: bool = False) -> Sequence[int]:
    """The positions module ``name``'s stored KV was encoded at: on its path (``scaffold``), else
    its own; a document's ``plain`` variant sits right after the system turn, not behind its
    neighbour context."""
    if name in schema.joint:
        return schema.joint[name].module_positions
    positions = schema.layout.modules[name].positions
    if plain:
        start = schema.layout.document_start
        return range(start, start + len(positions))
    return positions


_READERS: ThreadPoolExecutor | None = None
_READERS_LOCK = threading.Lock()


def _no_readers_after_fork() -> None:
    """In a forked child (:mod:`pc_rag.forks`): the pool's threads are the parent's; the child makes its own."""
    global _READERS, _READERS_LOCK
    _READERS, _READERS_LOCK = None, threading.Lock()


forks.after_fork_in_child(_no_readers_after_fork)


def _readers() -> ThreadPoolExecutor:
    """The threads that read modules concurrently (I/O and checksums release the GIL)."""
    global _READERS
    with _READERS_LOCK:
        if _READERS is None:
            # one per core, at most 8: checksums and parsing use the CPU too, and more readers than
            # cores starved the small commands of their timeouts (measured on 2 cores)
            _READERS = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="pc-rag-read")
        return _READERS


def _info(schema: Any, name: str) -> dict[str, Any]:
    module = schema.layout.modules.get(name)
    return {"schema": schema.name, "module": name, "tokens": len(module.token_ids) if module is not None else 0}
