"""How many intra-op threads a decode step runs with on a CPU: measured on the steps themselves.

A decode step of a small model is some two thousand small ATen ops, many of them parallelised by
OpenMP: each wakes the calling thread's team. pc-rag runs every pass on its scheduler thread, and
there, once another thread of the process has its own team (the caller's), the same ops ran far
slower with two threads (as when libgomp, managing more threads than CPUs, stops spinning its idle
threads and wakes them through the kernel for every region): on the 2-core development CPU a 4-bit
decode step took 78 ms with two threads and 53 ms with one (docs/performance.md, "Weights in 4
bits"). A wide pass (prefill, encoding) spends its time in few large products and keeps every
thread; on a machine with many cores one thread would starve decode instead. So neither count is
assumed: the first steps of each batch width alternate between one thread and the caller's
count, and the faster median is kept.

The count is set on the thread that runs the step (OpenMP's and MKL's settings are per thread)
and put back after it, whatever the step raised. ``torch.set_num_threads`` also sets the count a
thread started during the step begins with; the scheduler starts none.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .. import forks

logger = logging.getLogger(__name__)

TRIALS = 5  # steps timed with each count before one is kept
SKIPPED = 1  # first steps of a width not timed (first-call allocations, a compile)


def width_class(rows: int) -> int:
    """The class a step of ``rows`` rows is measured in: 1, 2-3, 4-7, 8-15, 16 and more."""
    return min(rows, 16).bit_length()


class DecodeThreads:
    """The thread count decode steps run with, per class of batch width (:func:`width_class`),
    chosen from one thread and the caller's count by timing steps (see the module docstring).

    ``chosen[width_class]`` holds what was kept; ``fixed`` (a count) skips the measurement.
    """

    def __init__(self, device: torch.device | str, fixed: int | None = None) -> None:
        self.enabled = torch.device(device).type == "cpu"
        self.fixed = fixed
        self.chosen: dict[int, int] = {}
        self._seen: dict[int, int] = {}
        self._times: dict[int, dict[int, list[float]]] = {}
        self._lock = threading.Lock()
        forks.renew_after_fork(self, "_lock")

    def candidates(self, current: int) -> tuple[int, ...]:
        """The counts measured against each other when the calling thread runs ``current`` threads."""
        return (1,) if current <= 1 else (1, current)

    def next_count(self, rows: int, current: int) -> tuple[int, bool]:
        """The count the next step of ``rows`` rows runs with, and whether its time is to be recorded."""
        if self.fixed is not None:
            return self.fixed, False
        width = width_class(rows)
        with self._lock:
            if width in self.chosen:
                return self.chosen[width], False
            seen = self._seen[width] = self._seen.get(width, 0) + 1
        options = self.candidates(current)
        if len(options) == 1:
            return options[0], False
        return options[seen % len(options)], seen > SKIPPED

    def record(self, rows: int, threads: int, seconds: float, current: int) -> None:
        """A timed step of ``rows`` rows took ``seconds`` with ``threads`` threads; once every
        candidate has :data:`TRIALS` times, the one with the lowest median is kept."""
        width = width_class(rows)
        with self._lock:
            if width in self.chosen:
                return
            times = self._times.setdefault(width, {})
            times.setdefault(threads, []).append(seconds)
            options = self.candidates(current)
            if any(len(times.get(n, ())) < TRIALS for n in options):
                return
            medians = {n: statistics.median(times[n]) for n in options}
            self.chosen[width] = min(options, key=medians.__getitem__)
        logger.info("decode steps of %d+ rows: %d thread(s) (median %s)", 1 << (width - 1), self.chosen[width],
                    ", ".join(f"{n} thread(s) {1000 * s:.1f} ms" for n, s in medians.items()))

    @contextmanager
    def step(self, rows: int) -> Iterator[None]:
        """Run one decode step of ``rows`` rows inside: with its thread count, timed while measuring."""
        if not self.enabled:
            yield
            return
        current = torch.get_num_threads()
        threads, timed = self.next_count(rows, current)
        if threads != current:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        try:
            yield
        finally:
            if threads != current:
                torch.set_num_threads(current)
        if timed:
            self.record(rows, threads, time.perf_counter() - started, current)


# ---------------------------------------------------------------------------------------------
# Narrow prefill passes: a cached prompt's computed tokens
# ---------------------------------------------------------------------------------------------
# passes of up to this many tokens (all rows) run as narrow_pass says: a cached prompt's question and
# recovered tokens (38-230 at 0.5-8K prompt tokens); its products take pc-rag's kernels up to as many
# rows (pc_rag.weights.blocks.KERNEL_ROWS)
NARROW_PASS_TOKENS = 256
_narrow = threading.local()  # the caller's count while a narrow pass runs on this thread


@contextmanager
def narrow_pass(tokens: int, enabled: bool) -> Iterator[None]:
    """A prefill pass of few ``tokens`` on a CPU whose linear layers run on pc-rag's kernels
    (``enabled``): torch's own ops (norms, rotations, activations, the residual adds) on this thread
    alone, the products (:func:`pc_rag.kernels.products.threads_for_kernels`) and attention
    (:func:`attention_threads`) on the caller's count.

    Why: an op of a few hundred rows is over torch's grain (32K values) and is parallelised, and on the
    scheduler thread, with the caller's OpenMP team in the same process, each parallel region wakes
    threads through the kernel: a multiply of 58 x 1536 values took 51 us there against 12 us on one
    thread (7 us with both threads on the thread that made the first team); a cached prompt's pass of
    58 tokens is some 600 of them. Measured on the 2-core development CPU, the embedded model, 1,064
    prompt tokens: the time to first token 224 ms with every op on both threads, 180 with this.
    """
    current = torch.get_num_threads()
    if not enabled or current <= 1 or tokens > NARROW_PASS_TOKENS:
        yield
        return
    from ..kernels.products import threads_for_kernels

    torch.set_num_threads(1)
    _narrow.count = current
    try:
        with threads_for_kernels(current):
            yield
    finally:
        _narrow.count = None
        torch.set_num_threads(current)


@contextmanager
def attention_threads() -> Iterator[None]:
    """Attention inside a :func:`narrow_pass` on the caller's count (a few large regions: the pass's
    queries over the whole cached context); elsewhere nothing changes."""
    count = getattr(_narrow, "count", None)
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
