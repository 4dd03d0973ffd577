"""Corpus encoding on a Ray cluster, into the remote tier that serving replicas read.

:func:`encode_documents` splits the documents into batches and hands them to a pool of Ray
actors; each actor loads the model once, encodes its batches with ``add_documents`` (KV written
to the remote tier, the batch's document records published once after it) and asks for more.
Ray retries the batch of an actor that dies (a new actor loads the model again); an entry
becomes visible in Redis only whole (see :mod:`pc_rag.kv.remote`), so a retry never meets half of
one, and encoding the same document twice writes the same bytes.

Runs on a local Ray runtime (``ray.init()`` with this machine's CPUs) or joins the cluster that
``RAY_ADDRESS`` names.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .errors import PromptCacheError
from .kv.redis_link import redact_url
from .kv.remote import RemoteTier
from .prompt import documents as docs_mod
from .prompt.documents import DEFAULT_SCHEMA
from .prompt.neighbours import DEFAULT_NEIGHBOURS, NeighbourIndex, check_context

logger = logging.getLogger(__name__)

__all__ = ["encode_documents"]


class _Encoder:
    """A Ray actor: one engine (the model loaded once) that encodes batches into the remote tier."""

    def __init__(self, model: str | None, remote_store: str, threads: int | None, engine_kwargs: dict[str, Any]) -> None:
        import torch

        from .engine import PromptCache

        if threads:
            torch.set_num_threads(threads)  # actors share the machine: one core each by default
        # a worker adds documents; it does not serve the ones already there
        self.engine = PromptCache.from_pretrained(model, remote_store=remote_store, remote_sync=False, remote_sync_interval_s=None,
                                                  **engine_kwargs)
        if not self.engine.remote.ping():  # type: ignore[union-attr]
            raise PromptCacheError(f"remote store {redact_url(remote_store)!r} is not reachable from this worker")

    def encode(self, batch: list[docs_mod.DocumentRecord], schema: str, system: str | None,
               context: tuple[str, dict[str, list[str]], dict[str, str]] | None = None) -> tuple[int, int]:
        """Encode one batch into the remote tier; a PromptCacheError unless every entry and the
        batch's records were written there (what the tier could not take would otherwise wait
        for a write-back that dies with this actor). ``context``: the form, each document's
        neighbours and the texts of those outside the batch (:mod:`pc_rag.prompt.neighbours`)."""
        before = self.engine.store_stats()["encoded"]
        form, neighbours_of, texts = context if context is not None else (None, None, None)
        self.engine.registry.add_documents(batch, schema=schema, system=system,
                                           progress=False, context=form, neighbours_of=neighbours_of, context_texts=texts)
        unwritten = self.engine.remote_backlog()
        if unwritten:
            raise PromptCacheError(f"{unwritten} entries or registry records could not be written to the remote store "
                                   f"({self.engine.remote.errors} errors; is it reachable, and not full?)")
        return len(batch), self.engine.store_stats()["encoded"] - before



def encode_documents(
    texts: Sequence[Any],
    *,
    model: str | None = None,
    remote_store: str,
    ids: Sequence[str] | None = None,
    metadatas: Sequence[dict[str, Any] | None] | None = None,
    num_workers: int | None = None,
    schema: str = DEFAULT_SCHEMA,
    system: str | None = None,
    batch_size: int = 16,
    progress: bool = True,
    context: str | None = "neighbours",
    neighbours: int = DEFAULT_NEIGHBOURS,
    embedding: Any = None,
    **engine_kwargs: Any,
) -> list[str]:
    """Encode documents on Ray workers into ``remote_store``; return their module names in input order.

    The names are those :meth:`pc_rag.PromptCache.add_documents` gives (``ids``, the Document or
    node id, or one derived from the text), so a replica built with the same ``remote_store``
    serves ``build_prompt(question, names)`` at once, encoding nothing. ``num_workers`` actors
    (default: the cluster's CPUs), each with one CPU and ``engine_kwargs`` for
    :meth:`PromptCache.from_pretrained`; ``batch_size`` documents per task. ``context`` and
    ``neighbours`` as :meth:`PromptCache.add_documents` takes them, on by default (a corpus encoded
    once on a cluster is read often; ``context=None``: each document alone): neighbours are found
    here, among the documents of this call (``embedding``), and each batch carries its
    neighbours' texts; each document is stored plain too, for a prompt that places it first.
    """
    check_context(context, neighbours)
    import ray
    from ray.util import ActorPool

    records = docs_mod.normalize(texts, ids, metadatas)  # everything validated before any worker starts
    _check_job(batch_size, num_workers, remote_store)
    named: dict[str, docs_mod.DocumentRecord] = {}
    for record in records:
        named.setdefault(record.name, record)  # a name given twice: its first record (normalize checked the texts agree)
    batches, contexts = _batches(named, batch_size, context, neighbours, embedding)
    if not ray.is_initialized():
        # RAY_ADDRESS joins a cluster; without it a local runtime with this machine's CPUs
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level=logging.WARNING)
    workers = num_workers if num_workers is not None else max(1, int(ray.cluster_resources().get("CPU", 1)))
    workers = min(workers, len(batches)) or 1
    actor = ray.remote(num_cpus=1, max_restarts=2, max_task_retries=2)(_Encoder)
    pool = ActorPool([actor.remote(model, remote_store, 1, engine_kwargs) for _ in range(workers)])
    encoded = 0
    with tqdm(total=len(named), desc="encoding on ray", unit="doc", disable=not progress) as bar:
        try:
            for done, fresh in pool.map_unordered(lambda a, job: a.encode.remote(job[0], schema, system, job[1]), list(zip(batches, contexts))):
                encoded += fresh
                bar.update(done)
        except ray.exceptions.RayError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, PromptCacheError):  # a worker's own verdict: the remote store did not take its batch
                raise PromptCacheError(f"encoding into {redact_url(remote_store)!r} failed: {cause}") from err
            raise
    logger.info("encoded %d of %d documents on %d Ray workers into %s", encoded, len(named), workers, remote_store)
    return [record.name for record in records]


def _check_job(batch_size: Any, num_workers: Any, remote_store: str) -> None:
    """Refuse a job that cannot run, before Ray starts any worker."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise PromptCacheError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if num_workers is not None and (not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1):
        raise PromptCacheError(f"num_workers must be an int >= 1 or None (the cluster's CPUs), got {num_workers!r}")
    if not RemoteTier(remote_store, "reachability-check").ping():
        raise PromptCacheError(f"remote store {redact_url(remote_store)!r} is not reachable")


def _batches(named: dict[str, docs_mod.DocumentRecord], size: int, context: str | None, neighbours: int,
             embedding: Any) -> tuple[list[list[docs_mod.DocumentRecord]], list[Any]]:
    """The workers' batches of records, and each batch's context: the form, each document's
    neighbours and the texts of those outside the batch (None without a context)."""
    unique = list(named.values())
    batches = [unique[i : i + size] for i in range(0, len(unique), size)]
    contexts: list[Any] = [None] * len(batches)
    if context is not None and neighbours:
        chosen = _neighbours(named, neighbours, embedding)
        for i, batch in enumerate(batches):
            inside = {record.name for record in batch}
            wanted = {name: chosen[name] for name in inside}
            outside = {n for names in wanted.values() for n in names if n not in inside}
            contexts[i] = (context, wanted, {n: named[n].text for n in outside})
    return batches, contexts


def _neighbours(named: dict[str, docs_mod.DocumentRecord], k: int, embedding: Any) -> dict[str, list[str]]:
    """Each document's ``k`` nearest among ``named`` by ``embedding``, the farthest first."""
    from .embedding import embed_texts, load_embedder

    model, _ = load_embedder(embedding)
    index = NeighbourIndex(lambda texts: embed_texts(model, texts))
    index.add({name: record.text for name, record in named.items()})
    return index.neighbours(list(named), k)
