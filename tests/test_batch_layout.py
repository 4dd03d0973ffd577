"""A running batch's layout (pc_rag.decode.layout): newcomers admitted in place, batches
combined with their rows packed, shared parts held and promoted, the reserved and vacant rows.

Each test builds running batches the way the scheduler does (one prompt prefilled alone, or
joining what a batch holds) on a tiny Llama with real documents, steps them by hand, and holds
every row's tokens to its lone call's.
"""

from __future__ import annotations

import pytest
import torch

from pc_rag import build_prompt
from pc_rag.decode import layout
from pc_rag.decode.layout import reserved_rows, vacant_rows
from pc_rag.decode.loop import RunningBatch


@pytest.fixture
def engine(make_engine):
    engine = make_engine("llama")
    docs = [f"Harbour {i} handles {i * 11} ships a day and lies {i * 3} km from the old town." for i in range(12)]
    engine.names = engine.add_documents(docs, progress=False)  # type: ignore[attr-defined]
    return engine


def test_rows_are_reserved_for_newcomers_only_where_unwritten_rows_hold_no_memory():
    """A rebuilt batch reserves rows for newcomers on a CPU (pages nobody wrote are not resident),
    not on a GPU, whose allocator commits them at once while the buffer budget counts the rows
    in use (16 reserved rows of 4K-token 8B KV are 8 GB the budget never saw), and not under
    compile (its step runs only over buffers its views span)."""
    assert reserved_rows(torch.device("cpu"), False, 16, 3) == 13
    assert reserved_rows(torch.device("cuda", 0), False, 16, 3) == 0
    assert reserved_rows(torch.device("cpu"), True, 16, 3) == 0
    assert reserved_rows(torch.device("cpu"), False, 4, 6) == 0  # a generate_batch wider than max_running


def test_a_compiled_batch_is_padded_to_a_power_of_two_rows_within_max_running():
    assert [vacant_rows(True, 16, rows) for rows in (1, 2, 3, 5, 8, 9, 16)] == [0, 0, 1, 3, 0, 7, 0]
    assert vacant_rows(True, 12, 9) == 3 and vacant_rows(True, 4, 6) == 0  # capped by max_running; never fewer rows
    assert vacant_rows(False, 16, 3) == 0  # eager steps: a vacant row would be compute for nothing


def running_alone(engine, prompt: str, tokens: int):
    """One prompt prefilled alone as a running batch of one row, as the scheduler admits it."""
    from pc_rag.decode.sampling import SamplingParams

    plans = engine._prepare([prompt], True)
    ticket = engine._ticket(plans, SamplingParams(max_new_tokens=tokens), True, 0.0, share=False)
    prefilled = engine._prefill(plans, tokens, True, share=False)
    return RunningBatch(engine.forward, prefilled.rows, ticket.requests, prefilled.logits, engine.spec)


def step(batch, out: dict) -> bool:
    """One take + feed; a row's request that finishes leaves its tokens in ``out``. Whether every row is done."""
    batch.take()
    for row, request in enumerate(batch.requests):
        if batch.alive[row] and batch.fed[row] is None:
            out[id(request)] = request.close()[1].token_ids
    if not batch.finished:
        batch.feed()
    return batch.finished


def test_arrivals_join_in_place_and_a_rebuild_packs_the_rows(engine):
    """Rows that join a running batch are written into a finished row's slot or a reserved row
    (the running rows are not copied, the write column jumps past a longer newcomer); a rebuild
    packs each row's live entries together. Every row's tokens equal its lone call's."""
    from pc_rag.decode.layout import live_runs

    engine.stop_token_ids.clear()
    names = engine.names
    budgets, documents = [6, 30, 20, 24, 4], [1, 2, 1, 2, 4]  # the last prompt, the longest, finishes first after joining
    prompts = [(build_prompt(f"Tell me about harbour {i}.", names[i : i + d]), n) for i, (n, d) in enumerate(zip(budgets, documents))]
    lone = [engine.generate(p, max_new_tokens=n).token_ids for p, n in prompts]
    out: dict[int, list[int]] = {}
    first, second = running_alone(engine, *prompts[0]), running_alone(engine, *prompts[1])
    for _ in range(3):
        step(first, out)
    batch = layout.combine([(first, [0]), (second, [0])], reserve=2)
    assert batch.rows.buffer.reserved == 2 and batch.batch == 2
    while not batch.requests[0].done:  # the first row finishes: its slot is free
        step(batch, out)
    storage = batch.rows.buffer.storage.data_ptr()
    longest = running_alone(engine, *prompts[4])  # the longest prompt: the column jumps to its length
    column = batch.length
    assert layout.admit(batch, longest) == [0]  # the finished row's slot
    assert batch.length == max(column, longest.length)
    assert layout.admit(batch, running_alone(engine, *prompts[2])) == [2]  # a reserved row
    assert layout.admit(batch, running_alone(engine, *prompts[3])) == [3]
    assert batch.rows.buffer.storage.data_ptr() == storage and batch.batch == 4  # nothing rebuilt
    assert layout.admit(batch, running_alone(engine, *prompts[3])) is None  # no free row left: the caller rebuilds
    while not batch.requests[0].done:  # the newcomer that made the column jump finishes
        step(batch, out)
    keep = [row for row, request in enumerate(batch.requests) if not request.done]
    live = [sum(b - a for a, b in live_runs(batch.rows.valid[row, : batch.length])) for row in keep]
    packed = layout.combine([(batch, keep)])
    assert packed.length == max(live) < batch.length  # the masked entries between are gone
    while not step(packed, out):
        pass
    requests = [first.requests[0], second.requests[0], *(batch.requests[row] for row in (2, 3, 0))]
    assert [out.get(id(r)) for r in requests] == lone


def test_rows_end_at_the_write_column_and_a_cpu_step_attends_within_each_rows_own_entries(engine, monkeypatch):
    """A rebuild and an in-place admission align each row's entries to end at the write column,
    so a row's prompt and what it decodes are one range; a CPU step's rows attend within their
    ranges (pc_rag.forward.row_extents) and a finished row to nothing. The logits are those of one
    attention call over the batch's whole width, and every row's tokens its lone call's."""
    from pc_rag.decode import loop
    from pc_rag.decode.layout import live_runs

    engine.stop_token_ids.clear()
    names = engine.names
    prompts = [(build_prompt("Tell me about harbour 1.", names[1:5]), 20), (build_prompt("Harbour 2?", names[2:3]), 3),
               (build_prompt("And harbour 3, briefly?", names[3:5]), 16), (build_prompt("Harbour 6?", names[6:7]), 8)]
    lone = [engine.generate(p, max_new_tokens=n).token_ids for p, n in prompts]
    out: dict[int, list[int]] = {}
    twin = layout.combine([(running_alone(engine, *p), [0]) for p in prompts[:3]], reserve=1)
    batch = layout.combine([(running_alone(engine, *p), [0]) for p in prompts[:3]], reserve=1)

    def one_range_to_the_column(rows):
        runs = [live_runs(batch.rows.valid[row, : batch.length]) for row in rows]
        assert all(len(r) == 1 and r[0][1] == batch.length for r in runs), runs
        return [r[0][0] for r in runs]

    starts = one_range_to_the_column(range(3))
    assert len(set(starts)) == 3 and min(starts) == 0  # three lengths, the longest from the first entry
    twin_out: dict[int, list[int]] = {}
    while not batch.requests[1].done:
        step(batch, out)
        with monkeypatch.context() as whole_width:
            whole_width.setattr(loop, "_extents", lambda *_: None)
            step(twin, twin_out)
        alive = [row for row, live in enumerate(batch.alive) if live]
        torch.testing.assert_close(batch.logits[alive], twin.logits[alive], rtol=1e-4, atol=1e-5)
    extents = loop._extents(batch.rows, batch.cursor, batch.spec, batch.alive)
    assert extents is not None and extents.starts[1] is None  # the finished row attends to nothing
    assert [extents.starts[row] for row in (0, 2)] == starts[::2]
    finished = batch.requests[1]
    assert layout.admit(batch, running_alone(engine, *prompts[3])) == [1]  # into the finished row's slot, aligned to the column
    assert one_range_to_the_column([1])[0] > 0
    while not step(batch, out):
        pass
    requests = [batch.requests[0], finished, batch.requests[2], batch.requests[1]]
    assert [out.get(id(r)) for r in requests] == lone


def test_a_newcomer_reads_what_running_rows_hold_and_a_copy_becomes_shared(engine):
    """Module KV shared across admissions: a newcomer importing the documents a running row copied
    into its own cache reads them as a part (nothing copied), and the running row switches to
    that part (its copy masked, dropped by the rebuild); a third arrival joins the same part,
    whose KV is the one already held. Every row's tokens equal its lone call's."""

    engine.stop_token_ids.clear()
    docs = engine.names[2:5]
    prompts = [(build_prompt(q, docs), n) for q, n in (("Which harbour is busiest?", 24), ("How far is harbour 3?", 16),
                                                         ("Name a harbour.", 12))]
    lone = [engine.generate(p, max_new_tokens=n).token_ids for p, n in prompts]
    out: dict[int, list[int]] = {}
    first = running_alone(engine, *prompts[0])
    copied = len(first.rows.copies[0])
    assert copied >= 3 and first.rows.shared is None  # alone: the documents are copied into its cache
    step(first, out)

    held = layout.held(first)
    assert len(held) == copied and set(held.values()) == {None}
    second = joining(engine, *prompts[1], held)
    assert second.rows.copies == [[]] and second.rows.shared is not None  # nothing copied: read where stored
    assert second.length == engine._prepare([prompts[1][0]], True)[0].computed_tokens  # its own cache: computed tokens only
    assert layout.promote(first, second.rows.shared) == 1
    assert first.rows.copies == [[]] and first.rows.shared is not None
    batch = layout.combine([(first, [0]), (second, [0])], reserve=1)
    assert batch.length < 64  # the copy is gone: each row holds its question and answer only
    assert all(part.rows == slice(0, 2) for part in batch.rows.shared.parts)
    step(batch, out)

    third = joining(engine, *prompts[2], layout.held(batch))
    held_kv = {part.kv.data_ptr() for part in batch.rows.shared.parts}
    assert {part.kv.data_ptr() for part in third.rows.shared.parts} <= held_kv  # the very tensors the batch reads
    assert layout.admit(batch, third) == [2]
    assert all(part.rows == slice(0, 3) for part in batch.rows.shared.parts)
    while not step(batch, out):
        pass
    requests = [first.requests[0], second.requests[0], third.requests[0]]
    assert [out.get(id(r)) for r in requests] == lone


def joining(engine, prompt: str, tokens: int, held):
    """One prompt prefilled to join a running batch that holds ``held``, as the scheduler admits it."""
    from pc_rag.decode.sampling import SamplingParams

    plans = engine._prepare([prompt], True)
    ticket = engine._ticket(plans, SamplingParams(max_new_tokens=tokens), True, 0.0, share=True)
    prefilled = engine._prefill(plans, tokens, True, True, held)
    return RunningBatch(engine.forward, prefilled.rows, ticket.requests, prefilled.logits, engine.spec)


def test_merge_says_what_it_allocated_and_let_go_of(engine):
    """layout.merge, the scheduler's one call per merge: a first batch as it is (or padded), a
    newcomer in place where a row is free (its own buffer let go), else a rebuild into a new
    buffer (the old ones let go), and a batch whose rows all finished dropped."""
    engine.stop_token_ids.clear()
    names = engine.names
    prompts = [(build_prompt(f"Tell me about harbour {i}.", names[i : i + 2]), n) for i, n in enumerate((3, 12, 8, 8))]
    lone = [engine.generate(p, max_new_tokens=n).token_ids for p, n in prompts]
    out: dict[int, list[int]] = {}
    no_reserve, one_reserved = (lambda rows: 0), (lambda rows: 1)
    first = running_alone(engine, *prompts[0])
    started = layout.merge(None, first, reserve=no_reserve, vacant=no_reserve)
    assert (started.batch, started.made, started.dropped, started.how) == (first, None, [], "started")
    padded = layout.merge(None, running_alone(engine, *prompts[0]), reserve=no_reserve, vacant=lambda rows: 3)
    assert padded.how == "started" and padded.batch.batch == 4 and padded.made is padded.batch.rows.buffer
    second = running_alone(engine, *prompts[1])
    rebuilt = layout.merge(first, second, reserve=one_reserved, vacant=no_reserve)  # no free row in a lone batch: rebuilt
    assert rebuilt.how == "rebuilt" and rebuilt.made is rebuilt.batch.rows.buffer
    assert rebuilt.dropped == [second.rows.buffer, first.rows.buffer] and rebuilt.batch.rows.buffer.reserved == 1
    batch = rebuilt.batch
    third = running_alone(engine, *prompts[2])
    in_place = layout.merge(batch, third, reserve=no_reserve, vacant=no_reserve)
    assert (in_place.batch, in_place.made, in_place.dropped, in_place.how) == (batch, None, [third.rows.buffer], "in place")
    assert batch.batch == 3
    while not batch.requests[0].done:  # the first row finishes: a newcomer takes its slot in place
        step(batch, out)
    assert layout.merge(batch, running_alone(engine, *prompts[3]), reserve=no_reserve, vacant=no_reserve).how == "in place"
    while not step(batch, out):
        pass
    dropped = layout.merge(batch, None, reserve=no_reserve, vacant=no_reserve)
    assert (dropped.batch, dropped.made, dropped.dropped, dropped.how) == (None, None, [batch.rows.buffer], "dropped")
    requests = [first.requests[0], second.requests[0], third.requests[0], batch.requests[0]]
    assert [out.get(id(r)) for r in requests] == lone
