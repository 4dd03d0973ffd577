"""Requests routed to the replica whose memory holds the documents they read (Ray Serve's
request-router API; its ``PrefixCacheAffinityRouter`` is the model, but pc-rag's reuse is not of
prefixes: a document is reused wherever it sits in the prompt).

Each replica reports, every second (``record_routing_stats``), the documents its memory tier
holds: their names and an *anchor* per document (the first :data:`ANCHOR_CHARS` characters of its
text). A request's score on a replica is the number of its documents held there: those it names
(``documents``) and those whose anchor appears in its prompt (a pasted document, as drop-in
finds it). The best-scoring replica is tried first, the least loaded among equals; when queues
are uneven (more than ``imbalance`` requests apart) the least loaded goes first whatever it holds.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

ANCHOR_CHARS = 64
MAX_REPORTED = 4096  # documents a replica reports (the most recently held first)


def routing_stats(engine: Any) -> dict[str, Any]:
    """What ``engine``'s memory tier holds, for the router: ``{"documents": [...], "anchors": [...]}``."""
    documents, anchors = [], []
    for collection, schema in engine.registry.snapshot().schemas.items():
        if not schema.layout.documents:
            continue
        for name, record in schema.documents.items():
            key = schema.keys.get(name)
            if key is not None and engine.store.in_memory(key):
                documents.append(f"{collection}/{name}")
                if len(record.text) >= ANCHOR_CHARS:
                    anchors.append(record.text[:ANCHOR_CHARS])
    return {"documents": documents[-MAX_REPORTED:], "anchors": anchors[-MAX_REPORTED:]}


def score(stats: dict[str, Any] | None, call: dict[str, Any] | None) -> int:
    """How many of the documents ``call`` reads a replica with ``stats`` holds in memory."""
    if not stats or not call:
        return 0
    held = set(stats.get("documents", ()))
    named = sum(1 for name in call.get("documents", ()) if any(entry.endswith("/" + name) for entry in held))
    prompt = call.get("prompt") or ""
    return named + sum(1 for anchor in stats.get("anchors", ()) if anchor in prompt)


class AffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """See the module docstring. ``imbalance``: queue-length difference past which load decides."""

    def initialize_state(self, imbalance: int = 4, **kwargs: Any) -> None:
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        call = None
        if pending_request is not None and pending_request.args and isinstance(pending_request.args[0], dict):
            call = pending_request.args[0]
        loads = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas}
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))  # ties broken at random
        if max(loads.values()) - min(loads.values()) > self.imbalance or call is None:
            return [sorted(shuffled, key=lambda r: loads[r.replica_id])]
        ranked = sorted(shuffled, key=lambda r: (-score(r.routing_stats, call), loads[r.replica_id]))
        return [[replica] for replica in ranked]
