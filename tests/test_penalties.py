"""OpenAI's presence and frequency penalties: each step's logits less the penalties of the tokens
generated so far (the prompt's not counted), the same alone, batched, and through LangChain."""

from __future__ import annotations

import pytest
import torch

from pc_rag import PromptCacheError

PROMPT = "one one one one one one one one"  # a prompt of one repeated token: not counted
# a negative presence penalty draws the tiny random model (which never repeats itself unprompted)
# back to what it generated, a positive frequency penalty away once a token comes often: both act
PENALTIES = {"presence_penalty": -2.0, "frequency_penalty": 0.7}


def test_each_step_chooses_under_the_penalties_of_what_it_generated(make_engine):
    engine = make_engine("llama")
    plain = engine.generate(PROMPT, max_new_tokens=24)
    penalized = engine.generate(PROMPT, max_new_tokens=24, output_logits=True, **PENALTIES)
    assert penalized.token_ids != plain.token_ids
    assert penalized.token_ids[0] == plain.token_ids[0]  # nothing generated yet: the prompt's tokens count for nothing
    for step, (token, logits) in enumerate(zip(penalized.token_ids, penalized.logits)):
        counts = torch.bincount(torch.tensor(penalized.token_ids[:step], dtype=torch.long), minlength=logits.shape[-1]).float()
        expected = logits - PENALTIES["frequency_penalty"] * counts - PENALTIES["presence_penalty"] * (counts > 0).float()
        assert int(expected.argmax()) == token


def test_batched_callers_and_langchain_get_the_lone_calls_tokens(make_engine):
    from langchain_core.messages import HumanMessage

    from pc_rag.integrations.langchain import ChatPromptCache

    engine = make_engine("llama")
    prompts = [PROMPT, "two three two three two three", "A plain prompt:"]
    alone = [engine.generate(p, max_new_tokens=16, **PENALTIES).token_ids for p in prompts]
    assert [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=16, **PENALTIES)] == alone
    chat = ChatPromptCache(engine=engine, max_new_tokens=16, **PENALTIES)
    reply = chat.invoke([HumanMessage(PROMPT)])
    direct = engine.generate(engine.render_chat([{"role": "user", "content": PROMPT}]), max_new_tokens=16, **PENALTIES)
    assert reply.content == direct.text
    unpenalized = engine.generate(engine.render_chat([{"role": "user", "content": PROMPT}]), max_new_tokens=16)
    assert ChatPromptCache(engine=engine, max_new_tokens=16).invoke([HumanMessage(PROMPT)]).content == unpenalized.text


@pytest.mark.parametrize(("name", "value"), [("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", float("nan")),
                                             ("presence_penalty", "1")])
def test_penalties_out_of_openais_range_are_refused(make_engine, name, value):
    engine = make_engine("llama")
    with pytest.raises(PromptCacheError, match=f"{name} must be a number from -2 to 2"):
        engine.generate("Hello", max_new_tokens=2, **{name: value})


def test_logit_bias_is_added_to_the_logits_at_every_step(make_engine):
    from langchain_core.messages import HumanMessage

    from pc_rag.integrations.langchain import ChatPromptCache

    engine = make_engine("llama")
    plain = engine.generate(PROMPT, max_new_tokens=6, output_logits=True)
    bias = {plain.token_ids[0]: -100, str(plain.token_ids[1]): 7.5}  # ids as ints or as JSON's strings
    biased = engine.generate(PROMPT, max_new_tokens=6, output_logits=True, logit_bias=bias)
    assert biased.token_ids[0] != plain.token_ids[0]
    for token, logits in zip(biased.token_ids, biased.logits):
        expected = logits.clone()
        expected[plain.token_ids[0]] -= 100
        expected[plain.token_ids[1]] += 7.5
        assert int(expected.argmax()) == token
    forcing = {plain.token_ids[2]: 100}
    chat = ChatPromptCache(engine=engine, max_new_tokens=6, logit_bias=forcing)  # ChatOpenAI's field
    rendered = engine.render_chat([{"role": "user", "content": PROMPT}])
    direct = engine.generate(rendered, max_new_tokens=6, logit_bias=forcing)
    assert direct.token_ids == [plain.token_ids[2]] * 6 and chat.invoke([HumanMessage(PROMPT)]).content == direct.text
    with pytest.raises(PromptCacheError, match="logit_bias names token 10000000; the model's vocabulary has"):
        engine.generate(PROMPT, max_new_tokens=2, logit_bias={10_000_000: 1})
    # refused when the call is made, before anything is queued (a server's request used to wait its turn first)
    with pytest.raises(PromptCacheError, match="logit_bias names token 10000000"):
        engine.astream(PROMPT, max_new_tokens=2, logit_bias={10_000_000: 1})
    for bad, says in (({"-3": 1}, "logit_bias keys are token ids"), ({5: 100.5}, "from -100 to 100"), ([5], "must map token ids")):
        with pytest.raises(PromptCacheError, match=says):
            engine.generate(PROMPT, max_new_tokens=2, logit_bias=bad)
