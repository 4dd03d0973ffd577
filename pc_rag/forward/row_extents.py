"""Each row of a CPU decode step attends over its own entries only.

A running batch's cache is one tensor ``[rows, kv_heads, entries, dim]`` as wide as its longest
row, and one batched attention call makes every row read that whole width, its mask hiding what
is not the row's: a shorter row's padding, the columns an in-place admission skipped, and every
entry of a row that has finished and only waits for its slot to be taken. A GPU's kernels are
bound by reading the cache and launching kernels, and one call is right there. On a CPU a
decode step's attention is compute, and a masked entry costs what a live one does: counted over
~2K-token prompts with private documents arriving over time, a step read 1.54-1.60 entries for
every live one (``benchmarks/serving.py reads``). So on a CPU the rows of a step attend a few
at a time (:attr:`RowExtents.group`), each call over the range ``[start, stop)`` that holds its
rows' live entries, the mask sliced to it, and rows that have finished attend to nothing (their
output is never read): the same product over the same entries with fewer masked ones (only the
summation order of the kernel's blocks changes).

The rows' layout decides how much is saved: a rebuilt batch aligns its rows to the right
(:func:`pc_rag.decode.layout.combine`), so that a row's entries and its decoded tokens
are one range ending at the write column.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KWARG = "pc_rag_extents"
# calls a few rows each cost more per entry read than one call over every row (the kernel's
# threads have less to share out): over rebuilt batches of 4-16 rows with 71-85% live entries they
# took 0.89-1.05x the time of one call (benchmarks/serving.py extents, before this bound), so they
# are used where they cost at most this share of one call
WORTHWHILE = 0.85


@dataclass(frozen=True)
class RowExtents:
    """Where each row's live entries lie in a batch's cache, for one decode step, and how the
    rows are grouped into kernel calls."""

    starts: tuple[int | None, ...]  # per row, its first live entry; None: the row is finished, nothing is attended
    stop: int  # the entry after the last one written (the step's write column + 1), the same for every row
    # consecutive rows per kernel call: a CPU kernel shares out (row, kv head) pairs among its
    # threads, and one row of 3 kv heads on 2 threads leaves one idle a third of the time (a row
    # per call measured 1.08x the batched call at 77% live entries, two rows per call 0.9x)
    group: int = 1

    @property
    def entries(self) -> int:
        """Cache entries the calls read, every row of a call over the call's range."""
        return sum((rows.stop - rows.start) * (entries.stop - entries.start) for rows, entries in self.spans())

    def spans(self) -> Iterator[tuple[slice, slice]]:
        """``(rows, entries)`` of each kernel call: ``group`` consecutive rows over the entries from
        the first live entry of any of them to ``stop``; groups whose rows are all finished are skipped."""
        for first in range(0, len(self.starts), self.group):
            rows = slice(first, min(first + self.group, len(self.starts)))
            starts = [start for start in self.starts[rows] if start is not None]
            if starts:
                yield rows, slice(min(starts), self.stop)


def extents_for(valid: torch.Tensor, stop: int, live: Sequence[bool], kv_heads: int, width: int | None = None) -> RowExtents | None:
    """The extents of rows whose ``valid [rows, entries]`` marks their live entries, entries
    ``stop`` and after unwritten; ``live[row]`` False for a finished row. Read on the host: meant
    for a cache on the CPU, where that costs no device sync. Rows are grouped so that every
    call's (row, kv head) pairs divide evenly among torch's threads. None where the calls would
    cost more than :data:`WORTHWHILE` of one call over every row's ``width`` entries.

    A call's cost is its busiest thread's: ``ceil(rows * kv_heads / threads)`` (row, kv head)
    pairs, each over the call's entries. A last group of fewer rows than the others leaves
    threads idle, which is why few rows (a batch of 3 rows of 3 kv heads on 2 threads: two calls
    of 3 and 2 pairs' time against one of 5) seldom gain."""
    first = valid[:, :stop].to(torch.uint8).argmax(dim=1).tolist()  # the first True of each row (0 for none)
    threads = torch.get_num_threads()
    group = threads // math.gcd(threads, kv_heads)
    extents = RowExtents(tuple(start if alive else None for start, alive in zip(first, live)), stop, group)
    if width is None:
        return extents

    def cost(rows: int, entries: int) -> int:
        return -(-rows * kv_heads // threads) * entries

    calls = sum(cost(rows.stop - rows.start, entries.stop - entries.start) for rows, entries in extents.spans())
    return extents if calls <= WORTHWHILE * cost(len(first), width) else None


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
           extents: RowExtents) -> torch.Tensor:
    """A decode step's attention by extents: ``query [rows, heads, 1, dim]`` over ``key``/``value``
    ``[rows, kv_heads, entries, dim]`` (``mask [rows, 1, 1, entries]``, boolean or additive, sliced
    alike); returns ``[rows, 1, heads, dim]`` like transformers' kernels, zeros for finished rows
    no call covers."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    out = query.new_zeros(rows, 1, heads, dim)
    for taken, entries in extents.spans():
        n = taken.stop - taken.start
        # each kv head's query heads stacked as its queries: [n, kv_heads, groups, dim], no key copies
        q = query[taken].reshape(n, kv_heads, heads // kv_heads, dim)
        span_mask = None if mask is None else mask[taken, :, :, entries]
        o = F.scaled_dot_product_attention(q, key[taken, :, entries], value[taken, :, entries], attn_mask=span_mask, scale=scale)
        out[taken, 0] = o.reshape(n, heads, dim)
    return out
