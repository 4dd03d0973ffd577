"""Warm-up (pc_rag.warm_up): a compiled engine compiles its decode step before the first caller.

Without it, the first callers of a compiled engine wait for torch.compile (seconds on a GPU,
ten or more here) and callers of new shapes wait again: a second batch size, a second capacity,
a RAG prompt whose APE bias made its mask a float one where a plain prompt's was boolean.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

from pc_rag import PromptCache, PromptCacheError, build_prompt
from pc_rag.forward.forward import COMPILE_MODES
from pc_rag.warm_up import batch_sizes

from .conftest import staggered

DOCS = [f"Harbour {i} handles {i * 11} ships a day and lies {i * 3} km from the old town." for i in range(10)]


def compilations() -> int:
    return counters["frames"].get("ok", 0)


def test_batch_sizes_are_the_ones_a_compiled_batch_is_padded_to():
    assert batch_sizes(16) == [1, 2, 4, 8, 16]
    assert batch_sizes(12) == [1, 2, 4, 8, 12]
    assert batch_sizes(1) == [1]


def test_after_warm_up_no_caller_waits_for_a_compilation(make_tiny, tokenizer):
    """After ``warm_up`` (plain prompts only), RAG callers arriving one after another up to 8
    rows, a lone RAG call, a batch of 3 and a batch needing a larger buffer compile nothing:
    the capacity is symbolic from the first compilation and every compiled step's mask is
    additive, APE bias or not. Tokens equal an eager engine's. Before, each of these shapes
    compiled on the caller's request (a boolean mask and a float one, a second capacity)."""
    engine = PromptCache(make_tiny("llama"), tokenizer, compile=True)  # APE's defaults: RAG rows carry a bias
    eager = PromptCache(make_tiny("llama"), tokenizer)
    torch._dynamo.reset()
    counters.clear()
    warm = engine.warm_up()
    assert {rows for rows, _ in warm.shapes} == set(batch_sizes(engine.scheduler.limits.max_running)) and not warm.left_out
    compiled = compilations()
    assert compiled >= 1

    for e in (engine, eager):
        e.stop_token_ids.clear()
        e.names = e.add_documents(DOCS, ids=[f"h{i}" for i in range(len(DOCS))], progress=False)  # type: ignore[attr-defined]
    prompts = [build_prompt(f"Which harbour is number {i}?", engine.names[i : i + 3]) for i in range(7)]
    long_plain = "A longer question. " + " ".join(f"w{i}" for i in range(100))  # ~300 tokens: a batch capacity of 512
    want = [eager.generate(p, max_new_tokens=30).token_ids for p in prompts]

    assert engine.generate(prompts[0], max_new_tokens=30).token_ids == want[0]
    # each arrives while the ones before it decode: 1, 2, 4 and 8 rows
    assert [result.token_ids for result in staggered(engine, prompts, max_new_tokens=30)] == want
    assert [g.token_ids for g in engine.generate_batch(prompts[:3], max_new_tokens=6)] == \
        [g.token_ids for g in eager.generate_batch(prompts[:3], max_new_tokens=6)]
    assert [g.token_ids for g in engine.generate_batch([long_plain, prompts[1]], max_new_tokens=4)] == \
        [g.token_ids for g in eager.generate_batch([long_plain, prompts[1]], max_new_tokens=4)]
    assert len({capacity for _, capacity in engine.forward.compiled_shapes}) > 1  # capacities the warm-up never ran
    assert compilations() == compiled
    assert engine.forward.compiled_steps == engine.scheduler.stats()["steps"]


def test_a_lone_row_left_in_a_batch_buffer_runs_the_lone_rows_graph(make_tiny, tokenizer, tmp_path):
    """The warm-up's lone row decodes in a pool buffer (capacity 1024); a row left alone when
    its batch-mate finishes goes on in the compacted batch's buffer (256). The step's inputs are
    views of one tensor, whose capacity torch.compile's guards do not check but its compiled
    code does: unless that tensor's capacity is symbolic too, a freshly compiled lone-row graph
    failed the row with "expected size 256==1024" (CI, a clean compile cache; a cache filled by
    other compilations hid it, hence an empty one here)."""
    engine = PromptCache(make_tiny("llama"), tokenizer, compile=True, max_running=4)
    eager = PromptCache(make_tiny("llama"), tokenizer, max_running=4)
    for e in (engine, eager):
        e.stop_token_ids.clear()
    torch._dynamo.reset()
    counters.clear()
    with temporary_cache_dir(str(tmp_path)):
        warm = engine.warm_up()
        assert (1, 1024) in warm.shapes
        compiled = compilations()

        def both(e: PromptCache) -> list[list[int]]:
            long = e.stream("Caller one counts: one, two,", max_new_tokens=30)
            next(long)
            short = e.stream("Caller two counts: one, two,", max_new_tokens=3)  # joins, then leaves first
            for stream in (short, long):
                for _ in stream:
                    pass
            return [stream.result.token_ids for stream in (long, short)]

        assert both(engine) == both(eager)
    assert (1, 256) in engine.forward.compiled_shapes
    assert compilations() == compiled and engine.scheduler.stats()["failed"] == 0


def test_a_batch_size_the_buffer_budget_refuses_is_left_out_not_an_error(make_engine):
    """A warm-up batch that alone exceeds ``buffer_budget`` is refused at submission as any
    request would be: warm-up logs it, leaves that size out and goes on."""
    probe = make_engine("llama")
    per_row = probe.spec.kv_bytes_per_token(probe.spec.dtype) * 256  # a warm-up row: one batch capacity
    engine = make_engine("llama", compile=True, buffer_budget=12 * per_row)
    warm = engine.warm_up()
    assert warm.left_out == [16]
    assert {rows for rows, _ in warm.shapes} == {1, 2, 4, 8}
    assert engine.scheduler.stats()["failed"] == 0


def test_an_eager_engine_warms_up_with_one_short_request(make_engine):
    engine = make_engine("llama")
    warm = engine.warm_up()
    assert warm.shapes == [] and engine.forward.passes >= 1 and engine.forward.compiled_steps == 0
    with pytest.raises(PromptCacheError, match="new_tokens must be an integer >= 2"):
        engine.warm_up(new_tokens=1)  # one token is the prefill's: no decode step would compile


def test_serve_offers_the_compile_modes_the_engine_takes():
    from pc_rag.cli import SERVE_COMPILE_MODES

    assert SERVE_COMPILE_MODES == COMPILE_MODES


def test_a_max_running_that_is_not_a_power_of_two_is_warmed_up_too(make_engine):
    """The scheduler pads a compiled batch to at most ``max_running`` rows, so 3 is a size it runs."""
    engine = make_engine("llama", compile=True, max_running=3)
    assert {rows for rows, _ in engine.warm_up().shapes} == {1, 2, 3}
