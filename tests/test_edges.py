"""The edges the engine once got wrong (issue 13), each against an independent oracle.

1. length-dependent RoPE (dynamic NTK, LongRoPE) never moves modules and never changes the
   model's rotary state; 2. sliding windows hold on every path; 3. a request finishes on the KV it
   was planned with; 4. a system turn away from where it was encoded is recovered like any
   moved module; 5. learned positions strictly increase; 6. an abandoned stream returns its
   buffer, and a batch's memory is admitted as a whole; 7. the fingerprint sees every weight.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from pc_rag import PML, PromptCache, PromptCacheError, build_prompt
from pc_rag.forward.rotation import RopeRotator
from pc_rag.model import spec as model_mod
from pc_rag.model.spec import model_fingerprint
from pc_rag.prompt.documents import DEFAULT_SYSTEM

DOCS = [
    "The lighthouse on the northern cape was automated in 1987 and still flashes every ten seconds.",
    "Ferries to the island leave twice a day in summer and once a day in winter, weather permitting.",
    "The island's only school teaches eleven children in two classrooms heated by a wood stove.",
]
QUESTION = "When was the lighthouse automated, and how often do the ferries leave?"

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
LONGROPE = {
    "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0 + i for i in range(8)],
    "original_max_position_embeddings": 32, "factor": 2.0, "rope_theta": 10000.0,
}


# 1 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope", [DYNAMIC, LONGROPE], ids=["dynamic", "longrope"])
def test_length_dependent_rope_keeps_modules_in_place(make_tiny, tokenizer, rope):
    model = make_tiny("llama", max_position_embeddings=64, rope_parameters=rope)
    engine = PromptCache(model, tokenizer)
    assert engine.position_kind == "rope_length_dependent" and not engine.movable
    with pytest.raises(PromptCacheError, match="change with the input length"):
        engine.add_documents(DOCS[:1], progress=False)
    # a PML schema keeps its positions, and a prompt within the short window is served from the cache
    engine.add_schema('<schema name="s"><module name="m">Short module text.</module></schema>', progress=False)
    plan = engine.plan(PML('<prompt schema="s"><m/> ok</prompt>'))
    assert plan.cached_tokens and all(s.position == s.source_position for s in plan.segments if s.cached)
    assert engine.generate(PML('<prompt schema="s"><m/> ok</prompt>'), max_new_tokens=3).stats.cached_tokens > 0


@pytest.mark.parametrize("rope", [DYNAMIC, LONGROPE], ids=["dynamic", "longrope"])
def test_rotating_keys_never_touches_the_models_rotary_state(make_tiny, rope):
    model = make_tiny("llama", max_position_embeddings=64, rope_parameters=rope)
    rotary = model.model.rotary_emb
    before = rotary.inv_freq.clone()
    keys = torch.randn(2, 2, 5, 16)
    RopeRotator(model).rotate_into(torch.empty_like(keys), keys, 500)  # far past both windows
    assert torch.equal(rotary.inv_freq, before)


@pytest.mark.parametrize("arch, window, rope", [
    ("llama", 32768, None), ("qwen2", 32768, None), ("llama", 131072, None),
    ("llama", 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_theta": 500000.0}),
], ids=["llama-32k", "qwen2-32k", "llama-128k", "llama3-scaling"])
def test_long_window_float32_rope_still_moves(make_tiny, tokenizer, arch, window, rope):
    """The probe past the window compared at a fixed tolerance took the model's own float32
    rounding of far angles (~1e-8 x position) for a change of frequencies: every float32 model
    with a 32K window or more was pinned to schema positions."""
    extra = {"rope_parameters": rope} if rope else {}
    engine = PromptCache(make_tiny(arch, max_position_embeddings=window, **extra), tokenizer)
    assert engine.position_kind == "rope" and engine.movable


def test_static_rope_scaling_still_moves(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), tokenizer)
    assert engine.position_kind == "rope" and engine.movable


# 2 ---------------------------------------------------------------------------------------------
def _windowed(tokenizer, arch: str, attn: str):
    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, sliding_window=16)
    if arch == "mistral":
        config = MistralConfig(**common)
    else:  # Qwen2: the second layer windowed, the first not (masks per layer type)
        config = Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn).eval()


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
@pytest.mark.parametrize("attn, assembly", [("sdpa", "copy"), ("eager", "copy"), ("sdpa", "in_place")])  # in place needs sdpa
def test_sliding_window_is_honoured_when_every_module_token_is_recomputed(tokenizer, arch, attn, assembly):
    model = _windowed(tokenizer, arch, attn)
    assert model.config.sliding_window == 16
    engine = PromptCache(model, tokenizer, recompute=10_000, assembly=assembly)
    prompt = build_prompt(QUESTION, engine.add_documents(DOCS, progress=False))
    plan = engine.plan(prompt)
    assert len(plan.input_ids) > 4 * 16  # the window really cuts
    with torch.no_grad():  # the oracle: the model's own forward of the token sequence
        reference = model(torch.tensor([plan.input_ids])).logits[0, -1]
    assert (engine.next_token_logits(prompt, use_cache=False) - reference).abs().max().item() <= 1e-4
    assert (engine.next_token_logits(prompt) - reference).abs().max().item() <= 1e-4
    # decoding past the window: cached steps equal full prefill's, one prompt or a batch
    full = engine.generate(prompt, max_new_tokens=24, use_cache=False)
    assert engine.generate(prompt, max_new_tokens=24).token_ids == full.token_ids
    other = build_prompt("Who teaches the children?", engine.add_documents(DOCS[1:], progress=False))
    expected = [full.token_ids, engine.generate(other, max_new_tokens=24, use_cache=False).token_ids]
    for share in (True, False):
        batch = engine.generate_batch([prompt, other], max_new_tokens=24, share_modules=share)
        assert [g.token_ids for g in batch] == expected
    assert engine.spec.sliding_window == 16 and engine.spec.mixed_window == (arch == "qwen2")


# 3 ---------------------------------------------------------------------------------------------
KB = '<schema name="kb"><system>Answer briefly.</system><user><module name="fact">{}</module></user></schema>'


def test_a_stream_finishes_on_the_kv_it_was_planned_with(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama", seed=2), tokenizer, recompute=0)
    engine.add_schema(KB.format("The harbour opens at six in the morning and closes at ten at night."), progress=False)
    prompt = PML('<prompt schema="kb"><fact/><user>When does the harbour open?</user></prompt>')
    expected = engine.next_token_logits(prompt)
    stream = engine.stream(prompt, max_new_tokens=6)  # planned now, prefilled on the first next()
    # another thread registers a new schema of the same name, with other text for the same module
    engine.add_schema(KB.format("Volcanic soil makes the vineyards on the southern slope unusually productive."), progress=False)
    engine.store.clear_memory()  # and the store forgets: the old module must be encoded again, from the old schema
    list(stream)
    replanned = engine.next_token_logits(prompt)
    assert (replanned - expected).abs().max().item() > 1e-3  # the new schema really answers differently
    old = PromptCache(engine.model, tokenizer, recompute=0)
    old.add_schema(KB.format("The harbour opens at six in the morning and closes at ten at night."), progress=False)
    assert stream.result.token_ids == old.generate(prompt, max_new_tokens=6).token_ids


def test_a_plan_reads_the_keys_it_pinned(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama"), tokenizer, recompute=0)
    engine.add_schema(KB.format("The harbour opens at six in the morning and closes at ten at night."), progress=False)
    plan = engine.plan(PML('<prompt schema="kb"><fact/><user>When?</user></prompt>'))
    keys = {s.owner: s.key for s in plan.segments if s.cached}
    engine.add_schema(KB.format("Something else entirely, with other words and another length too."), progress=False)
    assert {s.owner: s.key for s in plan.segments if s.cached} == keys
    assert engine.schemas["kb"].keys["fact"] != keys["fact"] and plan.sources["kb"].keys["fact"] == keys["fact"]


# 4 ---------------------------------------------------------------------------------------------
def test_a_system_turn_away_from_the_start_is_recovered(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama"), tokenizer, recompute=4, recompute_tail=0)
    engine.add_documents(DOCS[:1], progress=False)
    turn = engine.markers.starts["system"] + DEFAULT_SYSTEM + engine.markers.ends["system"]
    at_start = engine.plan(turn + "Where is the lighthouse?")
    assert [(s.owner, s.offset) for s in at_start.segments if s.cached] == [("#0", 0)]  # where it was encoded: exact
    mid = engine.plan("An earlier question, and its answer.\n" + turn + "Where is the lighthouse?")
    cached = [s for s in mid.segments if s.cached and s.owner == "#0"]
    assert cached and cached[0].position > 0 and cached[0].offset == 4  # moved: its head is recomputed
    assert not any(s.owner == "#0" and s.offset == 0 for s in mid.segments if s.cached)


# 5 ---------------------------------------------------------------------------------------------
TRIP = """<schema name="trip"><system>You plan trips.</system><user>
<module name="plan">Plan a few days of travel.</module>
<module name="budget">Budget: moderate.</module>
</user></schema>"""


def test_learned_positions_strictly_increase_or_the_prompt_is_refused(make_engine):
    engine = make_engine("gpt2", encoding="isolated")
    engine.add_schema(TRIP, progress=False)
    with pytest.raises(PromptCacheError, match="positions must increase"):
        engine.plan(PML('<prompt schema="trip"><plan/>and also some words in between<budget/><user>Cost?</user></prompt>'))
    with pytest.raises(PromptCacheError, match="schema order"):
        engine.plan(PML('<prompt schema="trip"><budget/><plan/></prompt>'))
    positions = engine.plan(PML('<prompt schema="trip"><plan/><budget/><user>Cost?</user></prompt>')).position_ids
    assert all(b > a for a, b in zip(positions, positions[1:]))


# 6 ---------------------------------------------------------------------------------------------
def test_an_abandoned_stream_returns_its_buffer(make_engine):
    engine = make_engine("llama")
    engine.generate("Warm the pool up.", max_new_tokens=2)
    idle = engine.buffers.idle
    stream = engine.stream("Tell me a long story about the sea.", max_new_tokens=50)
    next(stream)
    assert engine.buffers.in_use == 1 and engine.buffers.idle == idle - 1
    stream.close()  # the scheduler lets the row go at its next step
    for _ in range(2):  # the second request is admitted at a step that began after the close was seen
        engine.generate("Next.", max_new_tokens=1)
    assert engine.buffers.in_use == 0
    idle = engine.buffers.idle  # (the next request took a buffer while the closed one was let go)
    collected = engine.stream("Another long story, please.", max_new_tokens=50)
    next(collected)
    del collected
    gc.collect()
    for _ in range(2):
        engine.generate("Next.", max_new_tokens=1)
    assert engine.buffers.in_use == 0 and engine.buffers.idle == idle


def test_memory_budget_is_checked_for_a_whole_batch(make_tiny, tokenizer):
    probe = PromptCache(make_tiny("llama"), tokenizer, recompute=0)
    names = probe.add_documents(DOCS, progress=False)
    one = probe.plan(build_prompt("Lighthouse?", names[:1])).cached_tokens * probe._kv_bytes_per_token
    engine = PromptCache(probe.model, tokenizer, recompute=0, memory_budget=int(one * 1.1))
    names = engine.add_documents(DOCS, progress=False)
    first, second = build_prompt("Lighthouse?", names[:1]), build_prompt("Ferries?", names[1:2])
    engine.generate_batch([first, first], max_new_tokens=2)  # one document, held once: fits
    passes = engine.forward.passes
    with pytest.raises(PromptCacheError, match="the 2 prompts import .* more than memory_budget"):
        engine.generate_batch([first, second], max_new_tokens=2)
    assert engine.forward.passes == passes


# 7 ---------------------------------------------------------------------------------------------
def test_fingerprint_sees_a_single_edited_weight_and_the_versions(make_tiny, tokenizer, monkeypatch):
    model = make_tiny("llama")
    before = model_fingerprint(model, tokenizer)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[5, 3] += 1e-3  # off any stride a sample would take
    edited = model_fingerprint(model, tokenizer)
    assert edited != before
    real_version = model_mod.importlib.metadata.version
    monkeypatch.setattr(model_mod.importlib.metadata, "version",
                        lambda name: "0.0.0" if name == "transformers" else real_version(name))
    assert model_fingerprint(model, tokenizer) != edited


# performance on the way -----------------------------------------------------------------------
def test_spill_folder_is_written_on_eviction_only(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama"), tokenizer, memory_budget=1 << 30)  # no kv_dir: a private spill folder
    engine.add_documents(DOCS, progress=False)
    assert not list(engine.store.disk.root.rglob("*.safetensors"))  # nothing evicted, nothing written
    tight = PromptCache(engine.model, tokenizer, memory_budget=1)
    names = tight.add_documents(DOCS, progress=False)
    assert list(tight.store.disk.root.rglob("*.safetensors"))  # evicted: written
    assert tight.store.get(tight.schemas["docs"].keys[names[0]]) is not None  # and read back


def test_a_memory_hit_does_not_wait_for_another_requests_disk_read(make_tiny, tokenizer, tmp_path, monkeypatch):
    engine = PromptCache(make_tiny("llama"), tokenizer, kv_dir=tmp_path)
    names = engine.add_documents(DOCS, progress=False)
    keys = [engine.schemas["docs"].keys[n] for n in names]
    engine.store.clear_memory()
    assert engine.store.get(keys[0]) is not None  # back in memory
    entered, release = threading.Event(), threading.Event()
    original = type(engine.store.disk).load

    def slow_load(self, key, device="cpu", timing=None):
        entered.set()
        release.wait(30)
        return original(self, key, device, timing)

    monkeypatch.setattr(type(engine.store.disk), "load", slow_load)
    reader = threading.Thread(target=engine.store.get, args=(keys[1],))
    reader.start()
    assert entered.wait(30)
    try:
        assert engine.store.get(keys[0]) is not None  # would deadlock if the lock were held across the read
    finally:
        release.set()
        reader.join(30)
