"""Where module KV lives: a memory tier with an LRU byte budget, a disk tier, and optionally a
remote tier shared by replicas (:mod:`pc_rag.kv.remote`, Redis).

Disk format, one entry per module: ``<key>.safetensors`` (the payload) and ``<key>.json`` (the
record: key, engine fingerprint, file size, CRC-32 of the file), both as :mod:`pc_rag.kv.records`
writes them. Both are written to a temporary file and renamed into place, data first, so a
record only ever describes a complete data file; a process killed mid-write leaves at most an
orphaned temporary file. On load the record and the payload are checked as every tier checks
them (:mod:`pc_rag.kv.records`: key, fingerprint, size, checksum, and tensors that are this module
on this model); anything else is logged, deleted and reported as a miss, so the caller
re-encodes it. Nothing is unpickled: safetensors holds only raw tensors.

Keys are ``<collection>/<sha-256>`` (:func:`pc_rag.prefill.encode.entry_key`); on disk each collection
is a folder of its own.
"""

from __future__ import annotations

import atexit
import json
import logging
import mmap
import shutil
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .. import forks
from ..atomic import atomic_write
from .buffers import ModuleKV
from .load_or_compute import CostModel
from .quantize import quantize
from .records import KVShape, StoredKV, deserialize, new_record, payload_problem, record_problem, serialize, split_key

__all__ = ["KVShape", "ModuleStore", "open_store", "serialize", "split_key"]

logger = logging.getLogger(__name__)

class DiskTier:
    """Module KV persisted under ``root`` (see module docstring)."""

    def __init__(self, root: Path, fingerprint: str, *, orphan_age_s: float = 3600.0, durable: bool = True) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        # durable: a kv_dir that outlives the process, written when a module is encoded; a
        # private spill folder is written only when the memory tier evicts
        self.durable = durable
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_orphans(orphan_age_s)

    def _sweep_orphans(self, age_s: float) -> None:
        """Delete temporary files left by killed writers. A live writer renames its temporary file
        within seconds, so only files older than ``age_s`` are taken; another process may be
        writing the younger ones right now."""
        cutoff = time.time() - age_s
        for path in self.root.glob("*/*/.*.tmp"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    logger.info("removed %s, left by a writer that did not finish", path.name)
            except FileNotFoundError:  # another process swept it first
                pass

    def _paths(self, key: str) -> tuple[Path, Path]:
        collection, digest = split_key(key)
        folder = self.root / collection / digest[:2]
        return folder / f"{digest}.safetensors", folder / f"{digest}.json"

    def __contains__(self, key: str) -> bool:
        return self._paths(key)[1].is_file()

    def save(self, key: str, module: StoredKV, info: dict[str, Any]) -> None:
        data_path, manifest_path = self._paths(key)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        blob = serialize(module)
        atomic_write(data_path, blob)
        atomic_write(manifest_path, json.dumps(new_record(key, self.fingerprint, blob, **info), indent=1).encode())

    def load(self, key: str, device: torch.device | str = "cpu", timing: dict[str, float] | None = None) -> StoredKV | None:
        """The entry for ``key``, or ``None`` when absent or invalid (an invalid entry is removed).

        The data file is checksummed through a memory map and its tensors read from it straight
        onto ``device`` (no copy of the file into Python bytes first). ``timing`` receives the
        load's ``latency_s`` (the record), ``transfer_s`` (the payload) and ``bytes``.
        """
        data_path, manifest_path = self._paths(key)
        if not manifest_path.is_file():
            return None
        try:
            started = time.perf_counter()
            manifest = json.loads(manifest_path.read_text())
            problem = record_problem(manifest, key, self.fingerprint)
            if problem is None:
                read_at = time.perf_counter()
                with data_path.open("rb") as handle:
                    problem = payload_problem(manifest, data_path.stat().st_size, lambda: _file_crc32(handle))
                if problem is None:
                    with safe_open(str(data_path), framework="pt", device=str(device)) as tensors:
                        module = deserialize({name: tensors.get_tensor(name) for name in tensors.keys()})
                    if timing is not None:
                        timing.update(latency_s=read_at - started, transfer_s=time.perf_counter() - read_at, bytes=manifest["bytes"])
                    return module
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is treated the same way
            problem = f"unreadable ({exc})"
        logger.warning("discarding cache entry %s: %s; it will be re-encoded", key[:16], problem)
        self.discard(key)
        return None

    def discard(self, key: str) -> None:
        for path in self._paths(key):
            path.unlink(missing_ok=True)

    def size_bytes(self) -> int:
        """Bytes of the KV files under this tier's folder (a scan: for statistics, not hot paths)."""
        total = 0
        for path in self.root.glob("*/*/*.safetensors"):
            try:
                total += path.stat().st_size
            except FileNotFoundError:  # removed meanwhile
                pass
        return total


def _file_crc32(handle: Any) -> int:
    """CRC-32 of an open file, read through a memory map (no copy into Python bytes)."""
    with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return zlib.crc32(view)


class ModuleStore:
    """Module KV by key: memory tier (LRU, ``memory_budget`` bytes) over an optional disk tier.

    Entries evicted from memory are written to disk first (when a disk tier exists), so eviction
    never loses an encoding; a durable tier (``kv_dir``) is also written when a module is
    stored, a spill folder only on eviction. ``kv_dtype`` stores KV in a lower precision than the
    model's and ``shape.scheme`` (``kv_quantization``) in 8 or 4 bits (:mod:`pc_rag.kv.quantize`);
    the memory budget counts the bytes as stored. ``pin`` pins CPU-resident entries for fast
    host-to-device copies.

    A remote tier (``remote``) sits behind disk: a miss in memory and on disk reads it before the
    caller encodes, and every stored encoding is written to it; when it is unavailable it is
    skipped (see :class:`pc_rag.kv.remote.RemoteTier`), never failing a lookup.

    The lock guards the memory tier's bookkeeping only: disk and remote reads, checksums and writes happen
    outside it, so a memory hit never waits behind another request's I/O. An entry being written
    out on eviction stays readable from memory until its file is complete.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        kv_dtype: torch.dtype,
        memory_budget: int | None = None,
        disk: DiskTier | None = None,
        pin: bool = False,
        remote: Any = None,
        shape: KVShape | None = None,
    ) -> None:
        self.device = device
        self.shape = shape  # what entries read back from disk or the remote tier must be
        self.kv_dtype = kv_dtype
        self.memory_budget = memory_budget
        self.disk = disk
        self.pin = pin
        self.remote = remote  # pc_rag.kv.remote.RemoteTier or None
        self.costs: CostModel | None = None  # told how long each disk and remote load took (pc_rag.kv.load_or_compute)
        self._memory: OrderedDict[str, StoredKV] = OrderedDict()
        self._info: dict[str, dict[str, Any]] = {}
        self._unsaved: set[str] = set()
        self._writing: dict[str, StoredKV] = {}  # evicted, file not complete yet
        self._remote_pending: set[str] = set()  # stored while the remote tier was unavailable: written when it returns
        self._bytes = 0
        self._lock = threading.Lock()
        self._write_back_lock = threading.Lock()
        forks.renew_after_fork(self, "_lock", "_write_back_lock")
        self._write_back_thread: threading.Thread | None = None
        self.disk_loads = 0
        self.remote_loads = 0
        self.hits_memory = 0
        self.misses = 0
        self.evictions = 0

    @property
    def memory_bytes(self) -> int:
        return self._bytes

    def __contains__(self, key: str) -> bool:
        with self._lock:
            if key in self._memory or key in self._writing:
                return True
        if self.disk is not None and key in self.disk:
            return True
        return self.remote is not None and key in self.remote

    def in_memory(self, key: str) -> bool:
        return key in self._memory

    def locate(self, keys: Sequence[str]) -> dict[str, str | None]:
        """Which tier holds each of ``keys``: ``"memory"``, ``"disk"``, ``"remote"`` (asked in one
        pipelined round trip) or None."""
        where: dict[str, str | None] = {}
        with self._lock:
            for key in keys:
                where[key] = "memory" if key in self._memory or key in self._writing else None
        for key in keys:
            if where[key] is None and self.disk is not None and key in self.disk:
                where[key] = "disk"
        ask = [key for key in keys if where[key] is None]
        if self.remote is not None and ask:
            for key, found in zip(ask, self.remote.contains_many(ask)):
                where[key] = "remote" if found else None
        return where

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` some tier holds (the remote tier asked in one round trip, not one EXISTS per key)."""
        where = self.locate(keys)
        return [where[key] is not None for key in keys]

    def get(self, key: str, positions: Sequence[int] | None = None, *, count: bool = True) -> StoredKV | None:
        """The module under ``key`` from memory, else disk, else the remote tier (kept in memory
        then), else None; ``count=False`` leaves the hit/miss statistics alone (a second look by
        the same caller). An entry read from disk or the remote tier must be the KV of a module
        at ``positions`` on this model (:class:`KVShape`); one that is not is logged, deleted
        from its tier and passed over, so the caller encodes the module again."""
        if self._remote_pending and self.remote is not None and self.remote.available:
            self._write_back_soon()
        with self._lock:
            module = self._memory.get(key)
            if module is None:
                module = self._writing.get(key)
            else:
                self._memory.move_to_end(key)
            if module is not None:
                self.hits_memory += count
                return module
        device = self.device if not self.pin else "cpu"
        module, tier = None, None
        for tier, source in (("disk", self.disk), ("remote", self.remote)):
            timing: dict[str, float] = {}
            module = source.load(key, device, timing) if source is not None else None
            problem = self._problem(module, positions) if module is not None else None
            if problem is None and module is not None:
                if self.costs is not None and timing:
                    self.costs.observe_load(tier, timing["latency_s"], timing["transfer_s"], int(timing["bytes"]))
                break
            if problem is not None:
                logger.warning("discarding %s entry %s: %s; it will be re-encoded", tier, key[:48], problem)
                source.discard(key)  # type: ignore[union-attr]
                module = None
        if module is None:
            if count:
                with self._lock:
                    self.misses += 1
            return None
        with self._lock:
            if tier == "disk":
                self.disk_loads += 1
            else:
                self.remote_loads += 1
            # a remote entry stays in Redis: evicting it from memory loses nothing
            module, victims = self._remember(key, self._stored_form(module), saved=True)
        self._write_out(victims)
        return module

    def _problem(self, module: StoredKV, positions: Sequence[int] | None) -> str | None:
        if self.shape is None:
            return None
        return self.shape.problem(module, positions if positions is not None else module.positions.tolist())

    def _stored_form(self, module: StoredKV) -> StoredKV:
        """``module`` on the store's device, in its dtype, quantized under the shape's scheme
        (what every tier holds)."""
        scheme = self.shape.scheme if self.shape is not None else None
        if scheme is not None and isinstance(module, ModuleKV):
            module = quantize(module.kv, module.positions, scheme)
        return module.to(self.device, self.kv_dtype, pin=self.pin)

    def put(self, key: str, module: ModuleKV, info: dict[str, Any] | None = None, *, persist: bool = True) -> StoredKV:
        """Store ``module`` under ``key``: in memory and, with ``persist``, in the durable disk tier
        and the remote tier, every tier holding the same bytes (the store dtype); what the remote
        tier could not take now is written back when it answers again."""
        info = info or {}
        module = self._stored_form(module)
        durable = persist and self.disk is not None and self.disk.durable
        if durable:
            self.disk.save(key, module, info)  # type: ignore[union-attr]
        shared = persist and self.remote is not None and self.remote.save(key, module, info)
        with self._lock:
            self._info[key] = info
            if persist and self.remote is not None and not shared:
                self._remote_pending.add(key)
            module, victims = self._remember(key, module, saved=durable or shared)
        self._write_out(victims)
        return module

    def delete(self, keys: Sequence[str], *, remote: bool = True) -> None:
        """Remove the entries under ``keys`` from memory, disk and (``remote``) the remote tier."""
        with self._lock:
            for key in keys:
                module = self._memory.pop(key, None)
                if module is not None:
                    self._bytes -= module.nbytes
                self._writing.pop(key, None)
                self._unsaved.discard(key)
                self._remote_pending.discard(key)
                self._info.pop(key, None)
        for key in keys:
            if self.disk is not None:
                self.disk.discard(key)
        if self.remote is not None and remote:
            self.remote.delete_entries(keys)

    def unshared(self) -> list[str]:
        """Keys stored while the remote tier was unavailable and not written back yet."""
        with self._lock:
            return sorted(self._remote_pending)

    def _remember(self, key: str, module: StoredKV, *, saved: bool) -> tuple[StoredKV, list[tuple[str, StoredKV]]]:
        """Hold ``module`` (in its stored form) in memory (lock held); returns the evicted entries that need writing out."""
        old = self._memory.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._memory[key] = module
        self._bytes += module.nbytes
        if not saved:
            self._unsaved.add(key)
        return module, self._evict()

    def _evict(self) -> list[tuple[str, StoredKV]]:
        victims: list[tuple[str, StoredKV]] = []
        if self.memory_budget is None:
            return victims
        # keep the newest entry even when it alone exceeds the budget: the caller is using it
        while self._bytes > self.memory_budget and len(self._memory) > 1:
            key, module = self._memory.popitem(last=False)
            self._bytes -= module.nbytes
            self.evictions += 1
            logger.debug("evicted %s (%d bytes) from memory", key[:16], module.nbytes)
            if key in self._unsaved and self.disk is not None:
                self._unsaved.discard(key)
                self._writing[key] = module
                victims.append((key, module))
        return victims

    def write_back(self) -> int:
        """Write to the remote tier what was stored while it was unavailable (a restarted, empty
        Redis gets the encodings back), while it takes them; entries gone from memory since
        (spilled to disk, or dropped) are left to whoever encodes them next. Returns how many
        are still pending. Lookups start it in a background thread (:meth:`_write_back_soon`)."""
        with self._write_back_lock:  # one writer: two would upload the same entries twice
            with self._lock:
                pending = [(key, self._memory.get(key)) for key in self._remote_pending]
            for key, module in pending:
                if module is not None and not self.remote.save(key, module, self._info.get(key, {})):  # type: ignore[union-attr]
                    break  # unavailable again: keep the rest for later
                with self._lock:
                    self._remote_pending.discard(key)
                    if module is not None and self.disk is None:
                        self._unsaved.discard(key)  # held by the remote tier now: memory may drop it
        return len(self.unshared())

    def _write_back_soon(self) -> None:
        """:meth:`write_back` in a background thread, unless one runs: a lookup never waits for
        uploads (a pending backlog of modules is hundreds of MB over the network)."""
        with self._lock:
            if self._write_back_thread is not None and self._write_back_thread.is_alive():
                return
            self._write_back_thread = threading.Thread(target=self.write_back, name="pc-rag-write-back", daemon=True)
            self._write_back_thread.start()

    def settle(self, timeout: float | None = None) -> None:
        """Wait for a background write-back in flight (before shutdown, and in tests)."""
        thread = self._write_back_thread
        if thread is not None:
            thread.join(timeout)

    def _write_out(self, victims: list[tuple[str, StoredKV]]) -> None:
        """Write evicted entries to disk (outside the lock), then forget them."""
        for key, module in victims:
            try:
                self.disk.save(key, module, self._info.get(key, {}))  # type: ignore[union-attr]
            finally:
                with self._lock:
                    self._writing.pop(key, None)

    def clear_memory(self) -> int:
        """Drop every entry from the memory tier (saving unsaved ones to disk first); returns the bytes freed.

        Without a disk tier, only entries the remote tier holds are dropped: dropping the others
        would lose the encoding.
        """
        if self.disk is None:
            with self._lock:
                kept = OrderedDict((k, m) for k, m in self._memory.items() if k in self._unsaved or self.remote is None)
                freed = self._bytes - sum(m.nbytes for m in kept.values())
                self._memory, self._bytes = kept, self._bytes - freed
            return freed
        with self._lock:
            freed = self._bytes
            victims = [(key, module) for key, module in self._memory.items() if key in self._unsaved]
            for key, module in victims:
                self._writing[key] = module
            self._unsaved.clear()
            self._memory.clear()
            self._bytes = 0
        self._write_out(victims)
        return freed


    def stats(self, *, scan_disk: bool = True) -> dict[str, int]:
        """Hits per tier, misses, evictions and bytes held (see ``PromptCache.store_stats``)."""
        with self._lock:
            counts = {"hits_memory": self.hits_memory, "hits_disk": self.disk_loads, "hits_remote": self.remote_loads, "misses": self.misses,
                      "evictions": self.evictions, "bytes_memory": self._bytes,
                      "tokens_memory": sum(len(module) for module in self._memory.values())}
        # as stored (kv_quantization: codes, ranges and positions), over the entries in memory
        counts["bytes_per_token"] = round(counts["bytes_memory"] / counts["tokens_memory"]) if counts["tokens_memory"] else 0
        counts["bytes_disk"] = self.disk.size_bytes() if self.disk is not None and scan_disk else 0
        return counts


def open_store(
    *,
    fingerprint: str,
    kv_dir: Path | None,
    memory_budget: int | None,
    device: torch.device,
    kv_dtype: torch.dtype,
    pin: bool,
    remote: Any = None,
    shape: KVShape | None = None,
) -> ModuleStore:
    """The store an engine uses: memory, over ``kv_dir`` (durable) or, with a memory budget and
    no kv_dir, over a private spill folder that evicted modules go to (removed at exit); over
    ``remote`` (a :class:`pc_rag.kv.remote.RemoteTier`) when given."""
    disk = None
    if kv_dir is not None:
        disk = DiskTier(Path(kv_dir) / "kv" / fingerprint, fingerprint)
    elif memory_budget is not None:
        spill = tempfile.mkdtemp(prefix="pc-rag-spill-")
        atexit.register(shutil.rmtree, spill, True)
        disk = DiskTier(Path(spill), fingerprint, durable=False)
    return ModuleStore(device=device, kv_dtype=kv_dtype, memory_budget=memory_budget, disk=disk, pin=pin, remote=remote, shape=shape)
