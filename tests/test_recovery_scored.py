"""Scored recovery: ``recovery="query"`` (the question's attention chooses) and ``"deviation"``
(CacheBlend: the keys that deviate most from full prefill's), with ``recovery_budget``.

What must hold whatever a strategy chooses: recomputing every moved token is full prefill;
budget 0 is the paper's scheme; the tokens it recomputes are counted as computed; a batch
chooses for every row what that prompt alone would. The scores themselves are checked against
an independent computation (transformers' eager attention weights; full prefill's KV).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pc_rag import PML, PromptCache, PromptCacheError, build_prompt
from pc_rag.forward.forward import cache_keyword
from pc_rag.forward.probe import Probe
from pc_rag.prefill.pipeline import prefill_plans
from pc_rag.prefill.recovery import Recovery
from pc_rag.prefill.scored import Entries, top_entries

from .test_recovery import DOCS, QUESTION, SCHEMA


def _engine(model, tokenizer, **kwargs) -> PromptCache:
    kwargs.setdefault("recompute", 0)
    kwargs.setdefault("recompute_tail", 0)
    kwargs.setdefault("attention_temperature", 1.0)
    kwargs.setdefault("attention_scale", 1.0)
    engine = PromptCache(model, tokenizer, **kwargs)
    engine.add_schema(SCHEMA, progress=False)
    return engine


def _prompts(engine: PromptCache) -> list[str]:
    names = engine.add_documents(DOCS, progress=False)
    return [build_prompt(QUESTION, names), PML('<prompt schema="kb"><a/><b/><user>Which is second?</user></prompt>')]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("strategy", ["query", "deviation"])
@pytest.mark.parametrize("budget", [1.0, 10_000])
def test_recomputing_every_moved_token_is_full_prefill(make_tiny, tokenizer, arch, strategy, budget):
    # Mistral: a 16-token sliding window on every layer
    model = make_tiny(arch, num_hidden_layers=4, **({"sliding_window": 16} if arch == "mistral" else {}))
    engine = _engine(model, tokenizer, recovery=strategy, recovery_budget=budget)
    for prompt in _prompts(engine):
        cached = engine.generate(prompt, max_new_tokens=8, output_logits=True)
        full = engine.generate(prompt, max_new_tokens=8, use_cache=False, output_logits=True)
        torch.testing.assert_close(cached.logits[0], full.logits[0], atol=1e-4, rtol=1e-4)
        assert cached.token_ids == full.token_ids
        # only the exact prefix (and the first document, where it was encoded) stays cached
        assert 0 < cached.stats.cached_tokens < engine.plan(prompt).cached_tokens


@pytest.mark.parametrize("strategy", ["query", "deviation"])
def test_budget_zero_is_the_papers_scheme_and_a_budget_moves_towards_full_prefill(make_tiny, tokenizer, strategy):
    model = make_tiny("llama", num_hidden_layers=6)
    paper = _engine(model, tokenizer)
    engine = _engine(model, tokenizer, recovery=strategy, recovery_budget=0)
    prompt = _prompts(engine)[0]
    _prompts(paper)
    full = paper.next_token_logits(prompt, use_cache=False)
    torch.testing.assert_close(engine.next_token_logits(prompt), paper.next_token_logits(prompt), atol=1e-6, rtol=1e-6)
    distances = []
    for budget in (0.0, 0.5):
        engine.recovery = Recovery(strategy, budget)
        distances.append((engine.next_token_logits(prompt) - full).abs().max().item())
    assert distances[1] < distances[0]


@pytest.mark.parametrize("strategy", ["query", "deviation"])
def test_recomputed_tokens_are_counted_as_computed(make_tiny, tokenizer, strategy):
    engine = _engine(make_tiny("llama", num_hidden_layers=4), tokenizer, recovery=strategy, recovery_budget=7)
    prompt = _prompts(engine)[0]
    plan = engine.plan(prompt)
    stats = engine.generate(prompt, max_new_tokens=2).stats
    assert stats.cached_tokens == plan.cached_tokens - 7
    assert stats.computed_tokens == plan.computed_tokens + 7


@pytest.mark.parametrize("strategy", ["query", "deviation"])
def test_a_batch_chooses_for_each_prompt_what_it_would_alone(make_tiny, tokenizer, strategy):
    engine = _engine(make_tiny("llama", num_hidden_layers=4), tokenizer, recovery=strategy, recovery_budget=0.3)
    names = engine.add_documents(DOCS, progress=False)
    prompts = [build_prompt(QUESTION, names), build_prompt("Which city has a harbour?", names[::-1]), build_prompt("Why?", names[1:])]
    batch = engine.generate_batch(prompts, max_new_tokens=6, output_logits=True)
    for prompt, together in zip(prompts, batch):
        alone = engine.generate(prompt, max_new_tokens=6, output_logits=True)
        torch.testing.assert_close(together.logits[0], alone.logits[0], atol=1e-4, rtol=1e-4)
        assert together.token_ids == alone.token_ids
        assert together.stats.computed_tokens == alone.stats.computed_tokens


def test_probe_scores_are_the_attention_weights_transformers_computes(make_tiny, tokenizer):
    """The query strategy's score: attention probability from the chosen queries, summed over
    heads, queries and the first layers; compared with eager attention's own weights."""
    model = make_tiny("llama", num_hidden_layers=4)
    engine = PromptCache(model, tokenizer)  # switches the model to pc_rag_sdpa
    ids = torch.tensor([tokenizer("The river Elbe rises in the mountains and flows to Hamburg on the sea.")["input_ids"]])
    n = ids.shape[1]
    weight = torch.zeros(1, n)
    weight[0, -5:] = 1.0  # the last five tokens play the question
    probe = Probe(stop_after=1, query_weight=weight)
    from pc_rag.kv.buffers import KVBuffer

    engine.forward.probe(KVBuffer.for_model(model, n), ids, torch.arange(n)[None], None, probe)
    eager = make_tiny("llama", num_hidden_layers=4, attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions  # per layer [1, heads, n, n]
    expected = sum(a[0, :, -5:, :].sum(dim=(0, 1)) for a in attentions[:2])
    torch.testing.assert_close(probe.scores[0], expected, atol=1e-4, rtol=1e-4)


def test_deviation_leaves_the_first_layers_exact_for_every_token(make_tiny, tokenizer):
    """CacheBlend computes the check layer (and those before it) for every token: their KV is full prefill's."""
    model = make_tiny("llama", num_hidden_layers=4)
    engine = _engine(model, tokenizer, recovery="deviation", recovery_budget=2)
    prompt = _prompts(engine)[0]
    plan = engine._prepare([prompt], True)
    prefilled = prefill_plans(plan, 1, use_cache=True, share=False, recovery=engine.recovery, encoding=engine.encoding,
                              assembler=engine.assembler, assembly=engine.assembly, forward=engine.forward, spec=engine.spec,
                              buffers=engine.buffers)
    ids, positions = plan[0].input_ids, plan[0].position_ids
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=True, **{cache_keyword(model): cache})
    rows = prefilled.rows
    n = plan[0].cached_tokens
    where = {p: i for i, p in enumerate(positions)}
    index = torch.tensor([where[int(p)] for p in rows.key_positions[0, :n]])
    check = engine.recovery.check_layer
    for layer in range(check + 1):
        torch.testing.assert_close(rows.buffer.storage[layer, 0, 0, :, :n], cache.layers[layer].keys[0][:, index], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rows.buffer.storage[layer, 1, 0, :, :n], cache.layers[layer].values[0][:, index], atol=1e-5, rtol=1e-5)
    # past the check layer the cache still holds the reused (moved) KV, not full prefill's
    later = rows.buffer.storage[check + 1, 0, 0, :, :n]
    assert not torch.allclose(later, cache.layers[check + 1].keys[0][:, index], atol=1e-3)
    engine.buffers.release(rows.buffer)


def test_top_entries_take_the_best_scored_candidates_only():
    found = Entries(torch.zeros(2, 6, dtype=torch.long),
                    torch.tensor([[False, True, True, True, True, False], [True, True, True, False, False, False]]), [6, 3])
    scores = torch.tensor([[9.0, 1.0, 5.0, 3.0, 4.0, 8.0], [0.1, 0.3, 0.2, 7.0, 7.0, 7.0]])
    chosen = top_entries(scores, found, Recovery("query", 0.5))
    assert [c.tolist() for c in chosen] == [[2, 4], [1, 2]]  # 50% of 4 and of 3 candidates (rounded), never a non-candidate
    assert [c.tolist() for c in top_entries(scores, found, Recovery("query", 1))] == [[2], [1]]


def test_bad_recovery_arguments_are_refused(make_tiny, tokenizer):
    llama = make_tiny("llama")
    with pytest.raises(PromptCacheError, match="unknown recovery 'blend'"):
        PromptCache(llama, tokenizer, recovery="blend")
    for budget, message in ((1.5, "fraction must lie in"), (-3, "count must be >= 0"), (True, "recovery_budget must be"),
                            ("10%", "recovery_budget must be")):
        with pytest.raises(PromptCacheError, match=message):
            PromptCache(llama, tokenizer, recovery="query", recovery_budget=budget)
    with pytest.raises(PromptCacheError, match="head_tail' is set by recompute"):
        PromptCache(llama, tokenizer, recovery="head_tail", recovery_budget=0.1)
    for arch, attn in (("llama", "eager"), ("gpt2", "sdpa")):
        with pytest.raises(PromptCacheError, match="recovery='query' needs a RoPE model on sdpa"):
            PromptCache(make_tiny(arch, attn_implementation=attn), tokenizer, recovery="query")
    # the default falls back to fixed head/tail tokens where attention cannot be scored
    engine = PromptCache(make_tiny("llama", attn_implementation="eager"), tokenizer)
    assert engine.recovery.strategy == "head_tail"


def test_ape_adjusts_attention_to_moved_modules_only(make_tiny, tokenizer):
    """APE: a temperature and a scale on the attention from computed queries to moved cached tokens."""
    model = make_tiny("llama", num_hidden_layers=4)
    plain = _engine(model, tokenizer)
    prompt = _prompts(plain)[0]
    base = plain.next_token_logits(prompt)
    neutral = _engine(model, tokenizer, attention_temperature=1.0, attention_scale=1.0)
    _prompts(neutral)
    torch.testing.assert_close(neutral.next_token_logits(prompt), base, atol=1e-6, rtol=1e-6)
    for kwargs in ({"attention_scale": 0.5}, {"attention_temperature": 0.2}, {"attention_temperature": 0.5, "attention_scale": 0.7}):
        engine = _engine(model, tokenizer, **kwargs)
        _prompts(engine)
        adjusted = engine.generate(prompt, max_new_tokens=4, output_logits=True)
        assert (adjusted.logits[0] - base).abs().max().item() > 1e-4, kwargs
        # decoding keeps the adjustment; a batch that shares the moved modules (split attention:
        # the adjustment goes to the shared parts) equals each prompt alone
        names = engine.add_documents(DOCS, progress=False)
        # the second prompt shares the first two documents with the first, the third only the first
        # (its second document is the first's third, at another position): the first prompt's third
        # document is its own (private: adjusted through the mask), its second a shared part
        others = [build_prompt("Why?", names[:2]), build_prompt("Where?", [names[0], names[2]])]
        together = engine.generate_batch([prompt, *others], max_new_tokens=4, output_logits=True)
        singles = [adjusted] + [engine.generate(p, max_new_tokens=4, output_logits=True) for p in others]
        for got, alone in zip(together, singles):
            assert got.token_ids == alone.token_ids
            for a, b in zip(got.logits, alone.logits):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        # one request read in place (split attention) equals the copy
        in_place = _engine(model, tokenizer, assembly="in_place", **kwargs)
        _prompts(in_place)
        torch.testing.assert_close(in_place.next_token_logits(prompt), adjusted.logits[0], atol=1e-4, rtol=1e-4)
        # the stored module KV is untouched (the temperature scales this request's copy)
        torch.testing.assert_close(plain.next_token_logits(prompt), base, atol=1e-6, rtol=1e-6)
    # nothing moved, nothing adjusted: a prompt whose only module sits where it was encoded
    single = _engine(model, tokenizer, attention_scale=0.5)
    one = build_prompt(QUESTION, single.add_documents(DOCS[:1], progress=False))
    torch.testing.assert_close(single.next_token_logits(one), single.next_token_logits(one, use_cache=False), atol=1e-4, rtol=1e-4)
    for bad in (0, -1.0, True):
        with pytest.raises(PromptCacheError, match="attention_scale must be a number > 0"):
            PromptCache(model, tokenizer, attention_scale=bad)
    with pytest.raises(PromptCacheError, match="attention_temperature/attention_scale need a RoPE model"):
        PromptCache(make_tiny("gpt2"), tokenizer, attention_temperature=0.5)
