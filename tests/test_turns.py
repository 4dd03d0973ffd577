"""The model's turns (pc_rag.forward.turns): background encoding passes never overlap the scheduler's
steps, take their share of the model while requests are served, and all of it when none are."""

from __future__ import annotations

import threading
import time

import pytest

from pc_rag import PromptCacheError
from pc_rag.forward.turns import ModelTurns


def _busy(seconds: float) -> None:
    """Work that holds the model for ``seconds`` (a stand-in for a forward pass; no sleep: the CPU is used)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _run(turns: ModelTurns, passes: int, pass_s: float, step_s: float, *, urgent: bool = False) -> list[tuple[str, float, float]]:
    """A scheduler stepping (inside serving()) while ``passes`` background jobs run one after another;
    the (who, start, end) of every turn, in order."""
    log: list[tuple[str, float, float]] = []
    lock = threading.Lock()
    done = threading.Event()

    def record(who: str, work: float) -> None:
        start = time.perf_counter()
        _busy(work)
        with lock:
            log.append((who, start, time.perf_counter()))

    def background() -> None:
        for _ in range(passes):
            with turns.background(urgent=urgent):
                record("background", pass_s)
        done.set()

    with turns.serving():
        worker = threading.Thread(target=background)
        worker.start()
        while not done.is_set():
            with turns.step():
                record("scheduler", step_s)
        worker.join()
    return sorted(log, key=lambda entry: entry[1])


def test_background_passes_and_scheduler_steps_never_overlap_and_keep_the_share():
    turns = ModelTurns(share=0.25)
    log = _run(turns, passes=4, pass_s=0.02, step_s=0.005)
    for (_, _, end), (_, start, _) in zip(log, log[1:]):
        assert start >= end  # one at a time
    # after each background pass of d seconds, the scheduler ran d * (1 - share) / share of steps first
    passes = [i for i, (who, _, _) in enumerate(log) if who == "background"]
    for before, after in zip(passes, passes[1:]):
        owed = (log[before][2] - log[before][1]) * 3
        stepped = sum(end - start for who, start, end in log[before + 1:after] if who == "scheduler")
        assert stepped >= 0.9 * owed  # (the turns count a little more than the work inside them)
    assert len(passes) == 4 and turns.background_s > 0


def test_an_urgent_pass_does_not_wait_for_its_share():
    turns = ModelTurns(share=0.1)
    log = _run(turns, passes=3, pass_s=0.02, step_s=0.005, urgent=True)
    passes = [i for i, (who, _, _) in enumerate(log) if who == "background"]
    # a request waits for it: no 9x the pass of steps in between (one step at most slips in)
    assert all(after - before <= 2 for before, after in zip(passes, passes[1:]))


def test_a_job_nobody_added_takes_only_the_share_callers_documents_leave():
    """A learned passage (pc_rag.prompt.recurring) never delays a caller's document: the steps its
    pass owes hold back only the next job nobody added."""
    turns = ModelTurns(share=0.1)

    def job(**kwargs: bool) -> None:
        with turns.background(**kwargs):
            pass

    with turns.serving():
        with turns.background(behind=True):
            _busy(0.01)  # owes ~0.09 s of steps before the next such pass
        document = threading.Thread(target=job)
        document.start()
        document.join(timeout=60)
        assert not document.is_alive()  # a caller's document: its turn at once (no step ran)
        passage = threading.Thread(target=job, kwargs={"behind": True})
        passage.start()
        passage.join(timeout=0.5)
        assert passage.is_alive()  # the next passage waits for the steps owed (none ran: it cannot start)
        steps = 0
        while passage.is_alive():
            with turns.step():
                _busy(0.005)
            steps += 1
        assert steps >= 0.09 / 0.005 * 0.9


def test_an_idle_model_is_the_background_s():
    turns = ModelTurns(share=0.01)
    for _ in range(2):  # one job after another at once: an idle model owes nobody
        with turns.background():
            pass
    assert turns.background_s == 0


def test_a_lock_both_sides_take_inside_their_turns_never_deadlocks():
    """The encoder's lock: a background job holds it while it encodes, and a scheduler step takes it
    to encode a module evicted from memory. A turn taken inside that lock (per forward pass) would
    wait for the scheduler while the scheduler waits for the lock."""
    turns, lock = ModelTurns(share=0.5), threading.Lock()

    def background() -> None:
        for _ in range(20):
            with turns.background(), lock:
                _busy(0.001)

    with turns.serving():
        worker = threading.Thread(target=background, daemon=True)
        worker.start()
        while worker.is_alive():
            with turns.step(), lock:
                _busy(0.001)
            worker.join(0)
    worker.join(60)
    assert not worker.is_alive()


@pytest.mark.parametrize("share", [0, 1.5, -0.2, True, "half"])
def test_a_share_that_is_not_a_fraction_is_refused(share):
    with pytest.raises(PromptCacheError, match="encode_share"):
        ModelTurns(share)
