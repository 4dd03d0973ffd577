"""Rows of a CPU decode step attending within their own extents (pc_rag.forward.row_extents): the
same attention as one masked call over the batch's whole width, without reading what lies outside."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pc_rag.forward.row_extents import RowExtents, attend, extents_for
from pc_rag.forward.shared_attention import _attend, _attend_extents, _own_mask

ROWS, HEADS, KV_HEADS, DIM, ENTRIES = 5, 6, 2, 16, 40
STARTS = (0, 10, 25, None, 39)  # row 3 has finished; row 4 holds only the entry this step wrote
SKIPPED = slice(30, 33)  # columns an in-place admission skipped: masked inside rows 0-2's extents


class _Layer(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def _batch(outside: float) -> tuple[torch.Tensor, ...]:
    """A decode step's queries, keys, values and mask; entries outside a row's extent hold ``outside``."""
    torch.manual_seed(0)
    query = torch.randn(ROWS, HEADS, 1, DIM)
    key, value = torch.randn(ROWS, KV_HEADS, ENTRIES, DIM), torch.randn(ROWS, KV_HEADS, ENTRIES, DIM)
    mask = torch.zeros(ROWS, 1, 1, ENTRIES, dtype=torch.bool)
    for row, start in enumerate(STARTS):
        first = 0 if start is None else start
        mask[row, ..., first:] = True
        if start is not None and start < SKIPPED.start:
            mask[row, ..., SKIPPED] = False
        key[row, :, :first] = value[row, :, :first] = outside
    return query, key, value, mask


@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_rows_attending_within_their_extents_equal_one_masked_call(group):
    query, key, value, mask = _batch(outside=0.0)
    want = sdpa_attention_forward(_Layer(), query, key, value, mask, scaling=DIM**-0.5)[0]
    got = attend(query, key, value, mask, DIM**-0.5, RowExtents(STARTS, ENTRIES, group))
    live = [row for row, start in enumerate(STARTS) if start is not None]
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-6)
    if group == 1:  # a finished row no call covers: nothing attended, zeros
        assert torch.equal(got[3], torch.zeros_like(got[3]))


def test_a_row_alone_in_its_call_reads_nothing_before_its_extent():
    """NaN before each row's extent: one masked call over the whole width would meet it (0 x NaN),
    a call per row never reads it."""
    query, key, value, mask = _batch(outside=float("nan"))
    got = attend(query, key, value, mask, DIM**-0.5, RowExtents(STARTS, ENTRIES, 1))
    assert torch.isfinite(got).all()
    want = sdpa_attention_forward(_Layer(), *_batch(outside=0.0), scaling=DIM**-0.5)[0]
    torch.testing.assert_close(got[[0, 1, 2, 4]], want[[0, 1, 2, 4]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group", [1, 2])
def test_split_attention_over_the_rows_own_keys_within_extents_keeps_the_log_sum_exp(group):
    """What split attention merges with shared parts: output and log-sum-exp per row as one call gives them."""
    query, key, value, mask = _batch(outside=0.0)
    grouped = query.reshape(ROWS, KV_HEADS, HEADS // KV_HEADS, DIM)
    own = _own_mask(mask, 1, HEADS // KV_HEADS, ENTRIES, query)
    want_out, want_lse = _attend(grouped, key, value, DIM**-0.5, own)
    got_out, got_lse = _attend_extents(grouped, key, value, DIM**-0.5, own, RowExtents(STARTS, ENTRIES, group))
    live = [row for row, start in enumerate(STARTS) if start is not None]
    torch.testing.assert_close(got_out[live], want_out[live], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_lse[live], want_lse[live], rtol=1e-5, atol=1e-5)
    if group == 1:  # a finished row vanishes in any merge: output 0, log-sum-exp -inf
        assert torch.equal(got_out[3], torch.zeros_like(got_out[3])) and torch.isneginf(got_lse[3]).all()


def test_extents_start_at_each_rows_first_live_entry_and_group_rows_to_the_threads():
    _, _, _, mask = _batch(outside=0.0)
    valid = mask[:, 0, 0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        extents = extents_for(valid, ENTRIES, [True, True, True, False, True], kv_heads=3)
        assert extents.starts == STARTS and extents.stop == ENTRIES
        assert extents.group == 2  # 3 kv heads per row on 2 threads: two rows a call keep both busy
        assert list(extents.spans()) == [(slice(0, 2), slice(0, ENTRIES)), (slice(2, 4), slice(25, ENTRIES)),
                                         (slice(4, 5), slice(39, ENTRIES))]
        assert extents_for(valid, ENTRIES, [True] * ROWS, kv_heads=2).group == 1
    finally:
        torch.set_num_threads(threads)


def test_rows_that_fill_the_batch_keep_one_call_and_finished_rows_make_calls_worth_it():
    valid = torch.ones(4, 40, dtype=torch.bool)
    valid[0, :3] = False
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert extents_for(valid, 40, [True] * 4, kv_heads=2, width=40) is None  # 97% of one call's read: not worth it
        fewer = extents_for(valid, 40, [True, False, False, True], kv_heads=2, width=40)
        assert fewer is not None and fewer.entries == 37 + 40
    finally:
        torch.set_num_threads(threads)


def test_a_call_costs_its_busiest_threads_share_so_an_odd_row_out_must_save_enough():
    """3 rows of 3 kv heads on 2 threads: one call is 5 (row, head) pairs a thread at most, two
    calls 3 and 2, so splitting pays only where the rows' ranges shrink enough."""
    valid = torch.ones(3, 100, dtype=torch.bool)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert extents_for(valid, 100, [True] * 3, kv_heads=3, width=100) is None  # 300 + 200 against 500
        valid[2, :50] = False
        assert extents_for(valid, 100, [True] * 3, kv_heads=3, width=100) is not None  # 300 + 100 against 500
        valid[2, :50] = True
        valid[2, :30] = False
        assert extents_for(valid, 100, [True] * 3, kv_heads=3, width=100) is None  # 300 + 140 against 500: not 0.85
    finally:
        torch.set_num_threads(threads)
