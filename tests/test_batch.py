"""generate_batch: several prompts decoded together give exactly what generate gives each alone."""

from __future__ import annotations

import pytest

from pc_rag import PML, PromptCacheError, build_prompt

DOCS = [
    "The lighthouse on the northern cape was automated in 1987 and still flashes every ten seconds.",
    "Ferries to the island leave twice a day in summer and once a day in winter, weather permitting.",
    "The island's only school teaches eleven children in two classrooms heated by a wood stove.",
]


def _prompts(engine):
    names = engine.add_documents(DOCS, progress=False)
    return [
        build_prompt("When was the lighthouse automated?", names[:1]),
        build_prompt("How often do ferries leave in winter, and who decides?", names[1:]),
        "\n\n".join(DOCS) + "\n\nA plain prompt that quotes every document. Summary:",
        build_prompt("Hi", []),  # short, no modules: its row is mostly padding
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batch_equals_sequential_on_tiny_models(make_engine, arch):
    engine = make_engine(arch, recompute=4)
    prompts = _prompts(engine)
    for kwargs in ({"max_new_tokens": 12}, {"max_new_tokens": 12, "use_cache": False}, {"max_new_tokens": 9, "stop": ["e"]}):
        sequential = [engine.generate(p, **kwargs) for p in prompts]
        batched = engine.generate_batch(prompts, **kwargs)
        assert [r.token_ids for r in batched] == [r.token_ids for r in sequential]
        assert [r.text for r in batched] == [r.text for r in sequential]
        assert [r.finish_reason for r in batched] == [r.finish_reason for r in sequential]
        assert [(r.stats.cached_tokens, r.stats.computed_tokens, r.stats.modules) for r in batched] == [
            (r.stats.cached_tokens, r.stats.computed_tokens, r.stats.modules) for r in sequential
        ]


def test_batch_equals_sequential_on_the_embedded_model(smollm):
    prompts = _prompts(smollm)
    sequential = [smollm.generate(p, max_new_tokens=20) for p in prompts]
    batched = smollm.generate_batch(prompts, max_new_tokens=20)
    assert [r.token_ids for r in batched] == [r.token_ids for r in sequential]
    passes = smollm.forward.passes
    smollm.generate_batch(prompts, max_new_tokens=20)
    longest = max(len(r.token_ids) for r in sequential)
    # one prefill per prompt, then one forward pass per step for all of them together
    assert smollm.forward.passes - passes <= len(prompts) + longest


def test_models_without_custom_masks_are_served_one_by_one(make_engine):
    engine = make_engine("bloom")
    prompts = ["Alpha beta gamma delta.", "One two three."]
    assert [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=5)] == [
        engine.generate(p, max_new_tokens=5).token_ids for p in prompts
    ]


@pytest.mark.parametrize("arch", ["llama", "bloom", "gpt2"])
def test_bad_batches_fail_before_any_work(make_engine, arch):
    """Every prompt is planned before any work, on models served one prompt after another too
    (ALiBi, learned positions: the first prompt was answered before the second was refused)."""
    engine = make_engine(arch)
    with pytest.raises(PromptCacheError, match="sequence of prompts"):
        engine.generate_batch("one prompt")
    passes = engine.forward.passes
    with pytest.raises(PromptCacheError, match="prompt 1: .*unknown schema"):
        engine.generate_batch(["fine", PML('<prompt schema="nope"><user>x</user></prompt>')])
    assert engine.forward.passes == passes
    assert engine.generate_batch([]) == []


def test_langchain_llm_batch_uses_generate_batch(make_engine, monkeypatch):
    from pc_rag.integrations.langchain import PromptCacheLLM

    engine = make_engine("llama")
    prompts = [p for p in _prompts(engine)]
    calls = []
    original = engine.generate_batch
    monkeypatch.setattr(engine, "generate_batch", lambda ps, **kw: calls.append(len(ps)) or original(ps, **kw))
    llm = PromptCacheLLM(engine=engine, max_new_tokens=8, pml=True)  # the PML prompts are markup, the plain one text
    assert llm.batch(prompts) == [engine.generate(p, max_new_tokens=8).text for p in prompts]
    assert calls == [len(prompts)]


def test_langchain_chat_batch_uses_generate_batch_with_callbacks_per_conversation(make_engine, monkeypatch):
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.messages import HumanMessage

    from pc_rag.integrations.langchain import ChatPromptCache

    engine = make_engine("llama")
    names = engine.add_documents(["The ferry leaves at nine.", "The museum opens at ten.", "Trains run hourly."], progress=False)
    inputs = [[HumanMessage(build_prompt_text)] for build_prompt_text in ("When does the ferry leave?", "When does it open?", "How often?")]
    inputs.append("A plain string input")
    calls = []
    original = engine.generate_batch
    monkeypatch.setattr(engine, "generate_batch", lambda ps, **kw: calls.append(len(ps)) or original(ps, **kw))

    class Count(BaseCallbackHandler):
        starts = ends = 0

        def on_chat_model_start(self, *args, **kwargs):
            Count.starts += 1

        def on_llm_end(self, *args, **kwargs):
            Count.ends += 1

    chat = ChatPromptCache(engine=engine, max_new_tokens=6)
    batched = chat.batch(inputs, config={"callbacks": [Count()]})
    assert calls == [len(inputs)]  # one batched decode for all conversations
    assert (Count.starts, Count.ends) == (len(inputs), len(inputs))
    for got, item in zip(batched, inputs):
        alone = chat.invoke(item)
        assert got.content == alone.content
        assert got.usage_metadata == alone.usage_metadata
    assert names


def test_rows_sharing_a_module_with_different_ape_flags_keep_their_own(make_engine):
    # two rows import the same module at the same position, but in one it reads as moved (APE
    # adjusts the attention to it) and in the other as exact: a shared run must not impose the
    # first row's flags on the second (it did: the signature left the flags out)
    from pc_rag.prefill.ape import Ape
    from pc_rag.prefill.passes import prefill

    engine = make_engine("llama", recompute=0, recompute_tail=0)
    names = engine.add_documents(DOCS, progress=False)
    plan = engine.plan(build_prompt("When was the lighthouse automated?", names[:2]))
    cached = [s.cached for s in plan.segments]
    exact = [False] * len(cached)
    moved = list(cached)  # every cached segment read as moved

    def logits(plans, flags, share):
        assembled = engine.assembler.assemble(plans, 1, use_cache=True, assembly="copy", share=share, ape=Ape(0.8, 0.9, flags))
        out = prefill(engine.forward, assembled.rows, assembled.inputs, engine.spec)
        return [out[assembled.order.index(i)] for i in range(len(plans))]

    alone = [logits([plan], [flags], False)[0] for flags in (exact, moved)]
    assert float((alone[0] - alone[1]).abs().max()) > 1e-3  # APE changes what the moved row computes
    for flags in ([exact, moved], [moved, exact]):
        for share in (False, True):
            batch = logits([plan, plan], flags, share)
            for row, row_flags in zip(batch, flags):
                expected = alone[0] if row_flags is exact else alone[1]
                assert float((row - expected).abs().max()) < 1e-4, ("exact" if row_flags is exact else "moved", share)


# greedy batch outputs equal single calls, whatever reads the cached KV: APE on (the defaults) or
# off, rows sharing modules or not, one request reading the store in place or a copy, scored recovery
@pytest.mark.parametrize("ape", [True, False], ids=["ape", "no-ape"])
@pytest.mark.parametrize("share", [True, False], ids=["shared", "private"])
@pytest.mark.parametrize("assembly", ["copy", "in_place"])
@pytest.mark.parametrize("recovery", [None, "deviation"], ids=["head-tail", "scored"])
def test_batch_equals_single_calls_across_ape_sharing_assembly_and_recovery(make_engine, ape, share, assembly, recovery):
    settings = {"recompute": 0, "recompute_tail": 0, "assembly": assembly}
    if ape:
        settings.update(attention_temperature=None, attention_scale=None)  # the engine's defaults
    if recovery:
        settings.update(recovery=recovery, recovery_budget=0.2)
    engine = make_engine("llama", **settings)
    names = engine.add_documents(DOCS, progress=False)
    prompts = [
        build_prompt("When was the lighthouse automated?", names[:2]),  # the first document exact, the second moved
        build_prompt("How often do ferries leave?", names[:2]),  # the same modules: shared with the first
        build_prompt("Who teaches the children?", [names[2], names[0]]),  # the first document moved here
    ]
    single = [engine.generate(p, max_new_tokens=8, output_logits=True) for p in prompts]
    batch = engine.generate_batch(prompts, max_new_tokens=8, output_logits=True, share_modules=share)
    assert [r.token_ids for r in batch] == [r.token_ids for r in single]
    for b, s in zip(batch, single):
        assert float((b.logits[0] - s.logits[0]).abs().max()) < 1e-4
