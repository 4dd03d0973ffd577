"""Requests routed to the replica whose memory holds the documents they read (Ray Serve's
request-router API; its ``PrefixCacheAffinityRouter`` is the model, but pc-rag's reuse is not of
prefixes: a document is reused wherever it sits in the prompt).

Each replica reports, every second (``record_routing_stats``), the documents its memory tier
holds: their names, an *anchor* per document (the first :data:`ANCHOR_CHARS` characters of its
text) and the bytes it holds. A request reads the documents it names (``documents``) and those
whose anchor appears in its prompt (pasted, as drop-in finds them). The router also remembers
where it last sent each document (its *home*): a replica that loaded a document keeps it, while
reports lag by a second and a replica whose memory cannot hold everything it once encoded
reports less and less of it. A replica's score for a request is twice the documents whose home
it is plus the documents it reports holding; the best score goes first, then the least loaded,
then the one holding the fewest bytes (new documents spread over the replicas, so together they
hold more). When queues are uneven (more than ``imbalance`` requests apart) the least loaded goes
first whatever it holds.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

ANCHOR_CHARS = 64
MAX_REPORTED = 4096  # documents a replica reports (the most recently held first)


def routing_stats(engine: Any) -> dict[str, Any]:
    """What ``engine``'s memory tier holds, for the router: ``{"documents", "anchors", "bytes"}``."""
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
    return {"documents": documents[-MAX_REPORTED:], "anchors": anchors[-MAX_REPORTED:],
            "bytes": engine.store_stats().get("bytes_memory", 0)}


def read_documents(call: dict[str, Any], anchors: Any) -> set[str]:
    """The documents ``call`` reads, as routing keys: ``name:ID`` for those it names, the anchor
    for each of ``anchors`` its prompt contains."""
    prompt = call.get("prompt") or ""
    return {f"name:{n}" for n in call.get("documents", ())} | {a for a in anchors if a in prompt}


def held_keys(stats: dict[str, Any] | None) -> set[str]:
    """The routing keys of what a replica reports holding."""
    if not stats:
        return set()
    return {"name:" + entry.split("/", 1)[-1] for entry in stats.get("documents", ())} | set(stats.get("anchors", ()))


class AffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """See the module docstring. ``imbalance``: queue-length difference past which load decides."""

    def initialize_state(self, imbalance: int = 4, max_homes: int = 100_000, **kwargs: Any) -> None:
        self.imbalance = imbalance
        self.max_homes = max_homes
        self.homes: OrderedDict[str, Any] = OrderedDict()  # routing key -> the replica it was last sent to

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        call = _call(pending_request)
        loads = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas}
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))  # ties broken at random
        if max(loads.values()) - min(loads.values()) > self.imbalance or call is None:
            return [sorted(shuffled, key=lambda r: loads[r.replica_id])]
        held = {r.replica_id: held_keys(r.routing_stats) for r in candidate_replicas}
        reads = read_documents(call, set(self.homes).union(*held.values()))

        def rank(replica: RunningReplica) -> tuple[int, int, int]:
            homes = sum(1 for key in reads if self.homes.get(key) == replica.replica_id)
            score = 2 * homes + len(reads & held[replica.replica_id])
            return -score, loads[replica.replica_id], (replica.routing_stats or {}).get("bytes", 0)

        return [[replica] for replica in sorted(shuffled, key=rank)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        """The request's documents now live on ``replica_id`` (it will load or read them there)."""
        call = _call(pending_request)
        if call is None:
            return
        known = set(self.homes).union(*(held_keys(r.routing_stats) for r in self._replicas.values()))
        for key in read_documents(call, known):
            self.homes[key] = replica_id
            self.homes.move_to_end(key)
        while len(self.homes) > self.max_homes:
            self.homes.popitem(last=False)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, home in self.homes.items() if home == replica_id]:
            del self.homes[key]


def _call(pending_request: PendingRequest | None) -> dict[str, Any] | None:
    if pending_request is not None and pending_request.args and isinstance(pending_request.args[0], dict):
        return pending_request.args[0]
    return None
