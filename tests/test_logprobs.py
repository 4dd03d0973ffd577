"""Log-probabilities of generated tokens (``logprobs=k``): the model's raw distribution at each
step, whatever the sampling settings, the same alone, batched or decoding beside other callers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pc_rag import PromptCacheError, build_prompt

DOCS = [
    "The lighthouse on the northern cape was automated in 1987 and still flashes every ten seconds.",
    "Ferries to the island leave twice a day in summer and once a day in winter, weather permitting.",
]


def _prompts(engine) -> list[str]:
    names = engine.add_documents(DOCS, progress=False)
    return [build_prompt("When was the lighthouse automated?", names[:1]),
            build_prompt("How often do ferries leave?", names),
            "A plain prompt without modules:"]


def _assert_logprobs_of(result, top: int) -> None:
    """Each token's entry is log-softmax of that step's raw logits at the token, and its ``top``
    alternatives are the most likely tokens, most likely first."""
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) > 0
    for entry, token, logits in zip(result.logprobs, result.token_ids, result.logits):
        scores = torch.log_softmax(logits.float(), -1)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(scores[token]), abs=1e-5)
        values, ids = scores.topk(top)
        assert [i for i, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-5)


def test_logprobs_are_the_models_raw_distribution_at_each_step(make_engine):
    engine = make_engine("llama")
    prompt = _prompts(engine)[1]
    greedy = engine.generate(prompt, max_new_tokens=8, logprobs=3, output_logits=True)
    _assert_logprobs_of(greedy, 3)
    assert all(entry.top[0][0] == entry.token_id for entry in greedy.logprobs)  # greedy takes the most likely
    # sampled hot: the tokens differ from greedy's, their log-probabilities are still the model's own
    sampled = engine.generate(prompt, max_new_tokens=8, logprobs=2, output_logits=True, temperature=1.7, seed=3)
    _assert_logprobs_of(sampled, 2)
    plain = engine.generate(prompt, max_new_tokens=8)
    assert plain.logprobs is None and plain.token_ids == greedy.token_ids
    only_chosen = engine.generate(prompt, max_new_tokens=8, logprobs=0)
    assert [(e.token_id, e.top) for e in only_chosen.logprobs] == [(e.token_id, []) for e in greedy.logprobs]
    assert [e.logprob for e in only_chosen.logprobs] == pytest.approx([e.logprob for e in greedy.logprobs], abs=1e-6)


def test_a_stop_token_or_string_leaves_one_entry_per_generated_token(make_engine):
    engine = make_engine("llama")
    prompt = _prompts(engine)[0]
    first = engine.generate(prompt, max_new_tokens=12)
    stop = first.text[len(first.text) // 2:][:2]
    stopped = engine.generate(prompt, max_new_tokens=12, stop=[stop], logprobs=1)
    assert stopped.finish_reason == "stop" and len(stopped.logprobs) == len(stopped.token_ids)


def same_tokens(first: list, second: list) -> bool:
    """The same tokens with the same log-probabilities to float rounding: two calls of one prompt
    (a request's first decode steps may run at another thread count while the engine measures
    which is faster, pc_rag.forward.threads, and a product summed by two threads rounds its last
    bits otherwise: 1 in 4 runs differed by ~1e-6 at some token)."""
    return [e.token_id for e in first] == [e.token_id for e in second] and all(
        abs(a.logprob - b.logprob) < 1e-5 and [t for t, _ in a.top] == [t for t, _ in b.top] for a, b in zip(first, second))


async def test_streamed_pieces_carry_the_logprobs_of_the_tokens_they_complete(make_engine, tokenizer):
    """Each piece of a stream is a str with ``.logprobs``: the entries of the tokens whose text it
    completes, in order; joined, they are the result's (a stop sequence's cut tokens excepted)."""
    engine = make_engine("llama")
    engine.stop_token_ids.clear()
    prompt = _prompts(engine)[1]
    whole = engine.generate(prompt, max_new_tokens=24, logprobs=1)
    for stop in (None, [whole.text[5:9]]):
        stream = engine.stream(prompt, max_new_tokens=24, logprobs=1, stop=stop)
        pieces = list(stream)
        result = stream.result
        entries = [e for piece in pieces for e in piece.logprobs]
        assert entries == result.logprobs[: len(entries)] and "".join(pieces) == result.text
        if stop is None:  # without held-back text, each piece is the text of its own tokens
            assert len(pieces) > 1 and entries == result.logprobs and same_tokens(entries, whole.logprobs)
            assert all(tokenizer.decode([e.token_id for e in piece.logprobs], skip_special_tokens=True) == piece for piece in pieces)
        else:
            assert result.finish_reason == "stop" and len(entries) < len(result.logprobs)
    streamed = [piece async for piece in engine.astream(prompt, max_new_tokens=24, logprobs=1)]
    assert same_tokens([e for piece in streamed for e in piece.logprobs], whole.logprobs)
    assert all(type(piece) is str for piece in engine.stream(prompt, max_new_tokens=8))  # not asked for: plain text


def test_batched_and_concurrent_callers_get_their_lone_calls_logprobs(make_engine):
    engine = make_engine("llama")
    prompts = _prompts(engine)
    alone = [engine.generate(p, max_new_tokens=8, logprobs=2) for p in prompts]

    def same(results) -> None:
        for got, want in zip(results, alone):
            assert got.token_ids == want.token_ids
            assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
            assert [[i for i, _ in e.top] for e in got.logprobs] == [[i for i, _ in e.top] for e in want.logprobs]

    same(engine.generate_batch(prompts, max_new_tokens=8, logprobs=2))
    # threads, with callers beside them that ask for none
    with ThreadPoolExecutor(6) as pool:
        asked = [pool.submit(engine.generate, p, max_new_tokens=8, logprobs=2) for p in prompts]
        others = [pool.submit(engine.generate, p, max_new_tokens=8) for p in prompts]
        same([f.result() for f in asked])
        assert all(f.result().logprobs is None for f in others)


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "3"])
def test_bad_logprobs_are_refused_at_submission(make_engine, value):
    engine = make_engine("llama")
    with pytest.raises(PromptCacheError, match="logprobs must be an integer from 0 to 20"):
        engine.generate("Hello", max_new_tokens=2, logprobs=value)
