"""Admission (pc_rag.admission): which waiting tickets start, the chunk-or-batch rule, when a
batch is rebuilt. Tickets are real: planned by a tiny Llama engine over a real schema."""

from __future__ import annotations

import time

import pytest

from pc_rag.admission import COMPACTION_MIN_STEPS, FirstComeFirstServed, Limits, Room, in_chunks, rebuild_without_finished
from pc_rag.callers import Ticket
from pc_rag.decode.sampling import sampling_params

SCHEMA = '<schema name="shop"><module name="hours">The shop opens at nine and closes at five on weekdays.</module></schema>'


@pytest.fixture(scope="module")
def engine(make_tiny, tokenizer):
    from pc_rag import PromptCache

    engine = PromptCache(make_tiny("llama"), tokenizer, recompute=0)
    engine.add_schema(SCHEMA, progress=False)
    return engine


def ticket(engine, question: str = "When does it open?", *, prompts: int = 1, max_new_tokens: int = 8,
           use_cache: bool = True) -> Ticket:
    plans = [engine.plan(f'<prompt schema="shop"><hours/>{question}</prompt>') for _ in range(prompts)]
    params = sampling_params({"max_new_tokens": max_new_tokens}, engine.generation_config)
    return engine._ticket(plans, params, use_cache, time.perf_counter(), share=True)


def room(*, running: int = 0, max_running: int = 16, max_step_tokens: int = 512, one_pass: bool = True,
         fits=lambda cohort: True) -> Room:
    return Room(running=running, max_running=max_running, max_step_tokens=max_step_tokens, one_pass=one_pass, fits=fits)


def queued(*tickets: Ticket) -> FirstComeFirstServed:
    policy = FirstComeFirstServed()
    for t in tickets:
        policy.add(t)
    return policy


def test_first_come_first_served_takes_tickets_in_order_while_rows_fit(engine):
    a, b, c = ticket(engine), ticket(engine, prompts=2), ticket(engine)
    policy = queued(a, b, c)
    assert policy.choose(room(running=13)) == [a, b]  # 13 + 1 + 2 = 16; c would be the 17th row
    assert list(policy) == [c] and len(policy) == 1
    assert policy.choose(room(running=16)) == []  # no row free
    assert policy.choose(room()) == [c]


def test_a_ticket_that_does_not_fit_stops_the_choice_so_it_is_never_passed_over(engine):
    long, short = ticket(engine, "word " * 200), ticket(engine)
    policy = queued(long, short)
    assert policy.choose(room(running=1, fits=lambda cohort: long not in cohort)) == []
    assert list(policy) == [long, short]
    # with nothing running a lone ticket starts whatever the budget says (it was checked at submission)
    assert policy.choose(room(fits=lambda cohort: False)) == [long]


def test_the_step_budget_bounds_a_cohort_but_not_its_first_ticket(engine):
    first, second = ticket(engine, "word " * 40), ticket(engine)
    budget = first.tokens + second.tokens - 1
    assert queued(first, second).choose(room(max_step_tokens=budget)) == [first]
    assert queued(first, second).choose(room(max_step_tokens=first.tokens - 1)) == [first]
    assert queued(first, second).choose(room(max_step_tokens=budget + 1)) == [first, second]


def test_cancelled_tickets_leave_from_the_head_and_stop_the_choice_inside(engine):
    a, b, c = ticket(engine), ticket(engine), ticket(engine)
    a.cancelled = c.cancelled = True
    policy = queued(a, b, c)
    assert policy.drop_cancelled() == [a]
    assert policy.choose(room()) == [b]  # c is cancelled: not chosen, left for drop_cancelled
    assert policy.drop_cancelled() == [c] and len(policy) == 0


def test_tickets_retried_alone_go_back_first_and_each_starts_by_itself(engine):
    a, b, later = ticket(engine), ticket(engine), ticket(engine)
    policy = queued(later)
    for t in (a, b):
        t.alone = True
    policy.retry_first([a, b])
    assert list(policy) == [a, b, later]
    assert policy.choose(room()) == [a]
    assert policy.choose(room()) == [b]
    assert policy.choose(room()) == [later]


def test_cached_and_uncached_tickets_are_not_prefilled_together(engine):
    cached, full = ticket(engine), ticket(engine, use_cache=False)
    assert queued(cached, full).choose(room()) == [cached]


def test_attention_that_reads_cache_order_admits_one_request_at_a_time(engine):
    a, b, pair = ticket(engine), ticket(engine), ticket(engine, prompts=2)
    assert queued(a, b).choose(room(one_pass=False)) == [a]
    assert queued(a).choose(room(one_pass=False, running=1)) == []
    assert queued(pair).choose(room(one_pass=False)) == []  # two rows: never (it runs through its own path)


def test_a_newcomer_alone_beside_running_rows_is_prefilled_in_chunks(engine):
    limits = Limits(max_step_tokens=64)
    short, long, pair = ticket(engine), ticket(engine, "word " * 100), ticket(engine, prompts=2)
    assert long.tokens > 64 >= short.tokens
    assert in_chunks([long], limits, running=True, fusable=False)  # longer than a step's budget
    assert not in_chunks([short], limits, running=True, fusable=False)
    assert in_chunks([short], limits, running=True, fusable=True)  # its chunk rides on the decode step
    assert not in_chunks([long], limits, running=False, fusable=True)  # nothing decodes: one pass
    assert not in_chunks([pair], limits, running=True, fusable=True)
    assert not in_chunks([short, short], limits, running=True, fusable=True)


def test_a_batch_is_rebuilt_without_finished_rows_when_they_are_half_and_steps_remain():
    enough = COMPACTION_MIN_STEPS
    assert rebuild_without_finished(2, 4, enough, chunking=False)
    assert not rebuild_without_finished(1, 4, enough, chunking=False)  # a quarter
    assert not rebuild_without_finished(2, 4, enough - 1, chunking=False)  # too few steps to pay for the copy
    assert not rebuild_without_finished(2, 4, enough, chunking=True)  # a newcomer will take a slot
    assert not rebuild_without_finished(0, 0, enough, chunking=False)


class Recording(FirstComeFirstServed):
    """A policy beside the default: records what the scheduler asks it."""

    def __init__(self) -> None:
        super().__init__()
        self.rooms: list[Room] = []

    def choose(self, room: Room) -> list[Ticket]:
        self.rooms.append(room)
        return super().choose(room)


def test_the_scheduler_asks_the_policy_it_is_given(make_tiny, tokenizer):
    from pc_rag import PromptCache

    engine = PromptCache(make_tiny("llama"), tokenizer, recompute=0, max_running=3)
    engine.add_schema(SCHEMA, progress=False)
    engine.scheduler.policy = policy = Recording()
    out = engine.generate('<prompt schema="shop"><hours/>When?</prompt>', max_new_tokens=4)
    assert out.stats.generated_tokens >= 1
    assert policy.rooms and all(r.max_running == 3 for r in policy.rooms) and len(policy) == 0
