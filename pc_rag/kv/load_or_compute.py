"""Load or recompute: for module KV that is not in memory, whichever is faster.

A module in a slow tier (a distant or congested Redis, a network disk) can take longer to fetch
than to compute: on a GPU a 4K-token prefill takes tens of milliseconds while 190 MB cross a
socket. Per request, for the cached segments whose modules are not in memory, the engine
compares

    fetch   = tier latency + bytes x tier seconds-per-byte   (per tier, all its modules at once:
                                                              they are read concurrently and
                                                              share the tier's bandwidth)
    compute = tokens x prefill seconds-per-token

and either reads the modules (in parallel threads, before assembly) or computes their tokens in
the prompt itself, as full prefill would (exact, and no more work than prefill). Every rate is
measured online from this engine's own work: each disk and remote load reports its latency (the
small read before the payload) and its transfer (payload read, checked, parsed); each request
reports its prefill (computed tokens over the time from assembly to the first token, which on a
GPU includes the synchronisation the first token forces). Tier rates are exponentially weighted
moving averages, so a tier that slows down or recovers is followed within a few loads; prefill
time is a fixed cost plus a cost per token, fitted to the last prefills (:class:`PrefillRate`).

An engine with a disk or remote tier times one prefill when it starts (:data:`CALIBRATION_TOKENS`).
Until a tier and the prefill have both been measured, a tier's modules are loaded against a
deadline (:data:`RACE_FRACTION` of their estimated prefill, or :data:`MIN_SAVING_S` without any
prefill measured): what has
not arrived by then is computed in the prompt, and the loads go on into memory, measuring the
tier. So a cold replica behind a slow link is never much slower than computing. Computing wins only when clearly faster
(:data:`MARGIN`, :data:`MIN_SAVING_S`): the choice changes which tokens are computed, and must
not flip on noise.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .. import forks
from ..prompt.plan import Plan

logger = logging.getLogger(__name__)

SMOOTHING = 0.3  # weight of the newest observation
# computing replaces loading only when it is clearly faster: by this fraction of the load and by
# at least MIN_SAVING_S. The choice changes what a request computes (exact tokens instead of
# cached ones), so it should not flip back and forth on noise between two near-equal costs.
MARGIN = 0.1
MIN_SAVING_S = 0.005
# a tier not measured yet races the computation: its loads get this fraction of the estimated
# prefill of their tokens (a first request then costs at most ~1.2x computing them); loads not
# done by then go on into memory for later requests while this one computes those segments
RACE_FRACTION = 0.2
# an engine with a disk or remote tier times one prefill of this many tokens when it starts, so
# that its first requests weigh loads against a measured prefill (a short one overstates the cost
# per token of a long prompt: the loads it allows are the generous side of the race)
CALIBRATION_TOKENS = 256
SHORT_PREFIX = 1 / 8  # cached KV at most this share of the computed tokens, as a prefix: computed too


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class TierRate:
    """One tier's measured cost of a load: ``latency_s + bytes * s_per_byte``."""

    latency_s: float | None = None
    s_per_byte: float | None = None
    loads: int = 0

    def observe(self, latency_s: float, transfer_s: float, nbytes: int) -> None:
        self.latency_s = _blend(self.latency_s, max(latency_s, 0.0))
        if nbytes > 0:
            self.s_per_byte = _blend(self.s_per_byte, max(transfer_s, 0.0) / nbytes)
        self.loads += 1

    def expect(self, nbytes: int) -> float | None:
        """Seconds to load ``nbytes`` (None: not measured yet)."""
        if self.latency_s is None or self.s_per_byte is None:
            return None
        return self.latency_s + nbytes * self.s_per_byte


class PrefillRate:
    """Seconds to prefill ``n`` tokens, ``fixed + n * per_token``, fitted by least squares to the
    last :data:`WINDOW` prefills. A pass has a fixed cost (weights read once, launches), so the
    ratio of a short prefill (a question, ~20 tokens) overstates what each token of a long one
    costs (measured: 2.3x on the embedded model at 4K); until prefills of different sizes are
    seen, the ratio of the longest one is used."""

    WINDOW = 32

    def __init__(self) -> None:
        self.samples: list[tuple[int, float]] = []

    @property
    def largest(self) -> int:
        return max((n for n, _ in self.samples), default=0)

    def observe(self, tokens: int, seconds: float) -> None:
        self.samples = [*self.samples[-(self.WINDOW - 1):], (tokens, seconds)]

    def expect(self, tokens: int) -> float | None:
        if not self.samples:
            return None
        ns = [n for n, _ in self.samples]
        ts = [t for _, t in self.samples]
        mean_n, mean_t = sum(ns) / len(ns), sum(ts) / len(ts)
        spread = sum((n - mean_n) ** 2 for n in ns)
        if spread > 0 and max(ns) >= 4 * min(ns):
            slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts)) / spread
            if slope > 0:
                return max(0.0, mean_t - slope * mean_n) + slope * tokens
        n, t = max(self.samples)
        return tokens * t / n


class CostModel:
    """The rates :mod:`pc_rag.serving` decides with (see module docstring); thread-safe."""

    def __init__(self, *, min_saving_s: float | None = None) -> None:
        self.min_saving_s = MIN_SAVING_S if min_saving_s is None else min_saving_s
        self.tiers: dict[str, TierRate] = {}
        self.prefill = PrefillRate()
        self.recomputed_tokens = 0  # cached tokens computed in the prompt because their tier was slower
        self._lock = threading.Lock()
        forks.renew_after_fork(self, "_lock")

    def observe_load(self, tier: str, latency_s: float, transfer_s: float, nbytes: int) -> None:
        with self._lock:
            self.tiers.setdefault(tier, TierRate()).observe(latency_s, transfer_s, nbytes)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self.prefill.observe(tokens, seconds)

    def count_recomputed(self, tokens: int) -> None:
        with self._lock:
            self.recomputed_tokens += tokens

    def load_s(self, tier: str, nbytes: int) -> float | None:
        with self._lock:
            rate = self.tiers.get(tier)
            return rate.expect(nbytes) if rate is not None else None

    def compute_s(self, tokens: int) -> float | None:
        with self._lock:
            return self.prefill.expect(tokens)

    def recompute(self, tier: str, nbytes: int, tokens: int) -> bool:
        """Whether computing ``tokens`` is expected to be faster than loading ``nbytes`` from ``tier``.

        Exploration: when no prefill near this size has been seen (the longest is under a quarter
        of it) and the estimate, overstated by short prefills, is within 2x of the load, computing
        is tried once; its measurement settles the rate (else a replica that only ever loads would
        never learn that computing was faster)."""
        load, compute = self.load_s(tier, nbytes), self.compute_s(tokens)
        if load is None or compute is None:
            return False
        with self._lock:
            unexplored = self.prefill.largest * 4 < tokens
        if unexplored and compute < 2 * load and load - compute / 2 > self.min_saving_s:
            return True
        return compute < load * (1 - MARGIN) and load - compute > self.min_saving_s

    def never_load(self, tier: str, bytes_per_token: float) -> bool:
        """Whether computing is measured faster than loading from ``tier`` for a short module and
        a long prompt alike (both rates measured; recompute() would choose computing at either end)."""
        return all(self.recompute(tier, round(n * bytes_per_token), n) for n in (64, 4096))

    def snapshot(self) -> dict[str, float]:
        """The current estimates (for ``store_stats`` and logs)."""
        with self._lock:
            out: dict[str, float] = {}
            if self.prefill.samples:
                n, t = self.prefill.samples[-1]
                out["prefill_tokens_per_s"] = n / t  # the last prefill's
            for name, rate in self.tiers.items():
                if rate.latency_s is not None:
                    out[f"{name}_latency_ms"] = rate.latency_s * 1000
                if rate.s_per_byte:
                    out[f"{name}_mb_per_s"] = 1e-6 / rate.s_per_byte
            out["recomputed_tokens"] = self.recomputed_tokens
            return out


def load_or_compute(plans: Sequence[Plan], store: Any, costs: CostModel, bytes_per_token: float
                    ) -> tuple[list[Plan], list[str], float | None]:
    """The plans with the cached segments whose tier is slower than computing them turned into
    computed ones, the keys of the modules to load (not in memory, in a tier that is faster), and
    how long those loads may take (None: no limit; a deadline when a tier is not measured yet).

    Modules are grouped by the tier that holds them (one pipelined lookup for the remote tier);
    a tier's modules are loaded or computed together, since they would be read concurrently
    over its one bandwidth. A module no tier holds is left to assembly, which encodes and stores
    it (later requests find it in memory)."""
    module_tokens: dict[str, int] = {}  # key -> the module's stored tokens (what a load reads)
    read_tokens: dict[str, int] = {}  # key -> the tokens the plans read of it (what computing costs)
    for plan in plans:
        for segment in plan.segments:
            if segment.cached and not store.in_memory(segment.key):
                schema = plan.sources[segment.schema]
                module_tokens[segment.key] = len(schema.layout.modules[segment.owner].token_ids)
                read_tokens[segment.key] = read_tokens.get(segment.key, 0) + len(segment)
    if not module_tokens:
        return list(plans), [], None
    if store.disk is None and costs.never_load("remote", bytes_per_token):
        # the remote tier is measured slower than prefill at any size: compute them without even
        # asking where they are (that round trip can wait behind bulk transfers on a slow link)
        return compute_in_prompt(plans, set(module_tokens), costs), [], None
    where = store.locate(list(module_tokens))
    slower: set[str] = set()
    unmeasured = 0  # tokens read from tiers with no measurement yet (or before any prefill was measured)
    for tier in ("disk", "remote"):
        keys = [key for key, found in where.items() if found == tier]
        nbytes = round(sum(module_tokens[k] for k in keys) * bytes_per_token)
        if keys and (costs.load_s(tier, nbytes) is None or costs.compute_s(1) is None):
            unmeasured += sum(read_tokens[k] for k in keys)
        elif keys and costs.recompute(tier, nbytes, sum(read_tokens[k] for k in keys)):
            slower.update(keys)
    load = [key for key, found in where.items() if found in ("disk", "remote") and key not in slower]
    deadline = None
    if unmeasured:
        compute = costs.compute_s(unmeasured)
        deadline = MIN_SAVING_S if compute is None else max(RACE_FRACTION * compute, MIN_SAVING_S)
    return compute_in_prompt(plans, slower, costs), load, deadline


def short_prefixes(plans: Sequence[Plan]) -> set[str]:
    """Keys of cached segments to compute anyway: a plan whose cached KV is only a short prefix
    (at most a :data:`SHORT_PREFIX` share of what it computes, at positions 0.. that the computed
    tokens continue, e.g. the system prompt of a prompt whose documents were computed behind a
    slow tier) runs fastest as full prefill does, from an empty cache: attention over a cache that
    already holds entries takes an explicit mask instead of the causal kernel (measured 1.27x the
    time of full prefill at 2.4K tokens on CPU), and computing the prefix costs its few tokens."""
    keys: set[str] = set()
    for plan in plans:
        cached = [s for s in plan.segments if s.cached]
        computed = sum(len(s) for s in plan.segments if not s.cached)
        if not cached or sum(len(s) for s in cached) > SHORT_PREFIX * computed:
            continue
        if (plan.moved is not None and any(plan.moved)) or plan.segments[: len(cached)] != cached:
            continue
        if [s.position for s in plan.segments] == [sum(len(x) for x in plan.segments[:i]) for i in range(len(plan.segments))]:
            keys.update(s.key for s in cached)
    return keys


def compute_in_prompt(plans: Sequence[Plan], keys: set[str] | frozenset[str], costs: CostModel | None) -> list[Plan]:
    """The plans with the cached segments of modules ``keys`` computed in the prompt instead (at
    their positions, behind what precedes them: as full prefill computes them); counted as
    recomputed in ``costs`` (a tier slower than prefill) unless None."""
    if not keys:
        return list(plans)
    chosen = []
    for plan in plans:
        flags = plan.moved if plan.moved is not None else (False,) * len(plan.segments)
        segments, moved = [], []
        for segment, flag in zip(plan.segments, flags):
            computed = segment.cached and segment.key in keys
            segments.append(replace(segment, owner=None) if computed else segment)
            moved.append(flag and not computed)
            if computed and costs is not None:
                costs.count_recomputed(len(segment))
        chosen.append(replace(plan, segments=segments, moved=tuple(moved) if plan.moved is not None else None))
    logger.debug("computing %d modules in the prompt: their tier is slower than prefill", len(keys))
    return chosen
