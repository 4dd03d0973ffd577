"""PromptCache API: generation options, streaming, plain prompts, errors; one end-to-end run on SmolLM2."""

import pytest

from pc_rag import PML, CacheStats, Generation, PromptCache, PromptCacheError
from pc_rag.decode.request import IncrementalDetokenizer, StopFilter

SCHEMA = """<schema name="kb">
<system>Answer briefly.</system>
<user><module name="a">Alpha is the first letter.</module><module name="b">Beta is the second letter.</module></user>
</schema>"""
PROMPT = PML('<prompt schema="kb"><a/><b/><user>Which is second?</user></prompt>')


@pytest.fixture
def engine(make_engine):
    engine = make_engine("llama")
    engine.add_schema(SCHEMA, progress=False)
    return engine


def test_generate_reports_stats(engine):
    result = engine.generate(PROMPT, max_new_tokens=7)
    assert isinstance(result, Generation) and isinstance(result.stats, CacheStats)
    s = result.stats
    assert s.modules == ["a", "b"]
    assert s.cached_tokens + s.computed_tokens == len(engine.plan(PROMPT).input_ids)
    assert s.cached_tokens > s.computed_tokens > 0
    assert 0 < s.assemble_s <= s.ttft_s <= s.total_s
    assert s.generated_tokens == len(result.token_ids) == 7 and result.finish_reason == "length"


def test_add_schema_is_idempotent(engine):
    passes = engine.forward.passes
    assert engine.add_schema(SCHEMA, progress=False) is engine.schemas["kb"]
    assert engine.forward.passes == passes


def test_stream_yields_the_generated_text(engine):
    stream = engine.stream(PROMPT, max_new_tokens=12)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == engine.generate(PROMPT, max_new_tokens=12).text
    assert stream.stats.generated_tokens == 12


def test_detokenizer_is_correct_across_multibyte_characters(tokenizer):
    text = "naïve café – 日本語 🤗 ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == tokenizer.decode(ids)


def test_stop_filter_holds_back_partial_stops():
    f = StopFilter(["</s>", "END"])
    out = [f.feed(x) for x in ["hello E", "N", "x wor", "ld </", "s> tail"]]
    assert "".join(out) == "hello ENx world " and f.stopped


def test_stop_sequences_cut_the_text(engine):
    free = engine.generate(PROMPT, max_new_tokens=12).text
    stop = free[3:6]
    assert stop.strip()
    cut = engine.generate(PROMPT, max_new_tokens=12, stop=[stop])
    assert cut.text == free[: free.find(stop)] and cut.finish_reason == "stop"


def test_sampling_is_reproducible_with_a_seed(engine):
    a = engine.generate(PROMPT, max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=3)
    b = engine.generate(PROMPT, max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=3)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("extreme", [{"temperature": 1e-300}, {"temperature": 0.8, "top_p": 1e-300},
                                     {"temperature": 0.8, "top_p": 0.5, "top_k": 1}])
def test_sampling_at_the_edge_of_its_ranges_takes_the_top_token(engine, extreme):
    """Valid but extreme parameters (a temperature or top_p below float32's range) narrow sampling
    to the top token, their limit: the greedy answer, not NaN probabilities and an error."""
    greedy = engine.generate(PROMPT, max_new_tokens=8)
    assert engine.generate(PROMPT, max_new_tokens=8, seed=1, **extreme).token_ids == greedy.token_ids


def test_a_repetition_penalty_near_zero_samples_among_the_tokens_it_makes_certain(engine):
    """A penalty near 0 divides seen tokens' positive logits to +inf: those tokens share the mass
    (inf - inf made every probability NaN), and each one sampled is one of them."""
    prompt_ids = set(engine.plan(PROMPT).input_ids)
    out = engine.generate(PROMPT, max_new_tokens=8, temperature=0.8, repetition_penalty=1e-300, seed=2)
    assert len(out.token_ids) == 8
    seen = set(prompt_ids)
    for token in out.token_ids:
        assert token in seen  # only seen tokens had their logits sent to +inf
        seen.add(token)


def test_plain_text_prompt_runs_without_modules(engine):
    result = engine.generate("The capital of France is", max_new_tokens=3)
    assert result.stats.cached_tokens == 0 and result.stats.modules == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
        ({"temperature": -1}, "temperature must be a finite number >= 0"),
        ({"top_p": 0}, "top_p must be in"),
        ({"stop": [""]}, "stop sequences must be non-empty"),
        # past torch's 64-bit range the generator raised a bare ValueError (a 500 behind the server)
        ({"temperature": 1.0, "seed": 2**64}, "seed must be an integer in"),
        ({"temperature": 1.0, "seed": -(2**63) - 1}, "seed must be an integer in"),
        ({"temperature": 1.0, "seed": 1.5}, "seed must be an integer in"),
        ({"temperature": 1.0, "seed": True}, "seed must be an integer in"),
        # these raised TypeError, or (NaN) failed the scheduler's step and every row sharing it
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": "x"}, "top_p must be in"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"do_sample": "yes"}, "do_sample must be True, False or None"),
        ({"max_new_tokens": True}, "max_new_tokens must be a positive integer"),
        ({"use_cache": "no"}, "use_cache must be True or False"),
        # every stop is searched for after every token on the loop that steps every caller's rows:
        # 100,000 of them took 300 ms per token, for everyone
        ({"stop": [f"s{i}" for i in range(17)]}, "at most 16 stop sequences, got 17"),
        ({"stop": ["x" * 257]}, "a stop sequence is at most 256 characters, got one of 257"),
    ],
)
def test_bad_generation_arguments(engine, kwargs, message):
    with pytest.raises(PromptCacheError, match=message):
        engine.generate(PROMPT, **kwargs)


def test_unknown_schema_lists_the_known_ones(engine):
    with pytest.raises(PromptCacheError, match=r"unknown schema 'kbb' \(schemas this request may read: kb\)"):
        engine.generate(PML('<prompt schema="kbb"><a/></prompt>'))


def test_prompt_longer_than_the_context_window_is_refused(engine):
    with pytest.raises(PromptCacheError, match="context window"):
        engine.generate("word " * 1100)


def test_unknown_encoding(make_engine):
    with pytest.raises(PromptCacheError, match="unknown encoding 'contiguous'"):
        make_engine("llama", encoding="contiguous")


def test_end_to_end_on_the_embedded_model():
    engine = PromptCache.from_pretrained()
    assert engine.position_kind == "rope" and engine.markers.generation == "<|im_start|>assistant\n"
    engine.add_schema(
        """<schema name="facts">
        <system>You are a helpful assistant. Answer from the document.</system>
        <user><module name="paris">Paris is the capital and largest city of France.</module></user>
        </schema>""",
        progress=False,
    )
    prompt = PML('<prompt schema="facts"><paris/><user>What is the capital of France?</user></prompt>')
    cached = engine.generate(prompt, max_new_tokens=16)
    full = engine.generate(prompt, max_new_tokens=16, use_cache=False)
    assert cached.text.strip() and cached.text == full.text
    assert cached.token_ids == full.token_ids
    assert (engine.next_token_logits(prompt) - engine.next_token_logits(prompt, use_cache=False)).abs().max().item() <= 1e-3
    assert cached.stats.cached_tokens > 0 and full.stats.cached_tokens == 0
