"""Cached inference against full prefill, on tiny random models of every position scheme.

The oracle is the plain transformers forward pass over the prompt's token sequence at the
plan's positions. With module KV encoded contiguously (each module behind everything before it
in this prompt, which the test obtains by slicing the oracle's own KV), assembly must be
lossless: positions, moves, parameter arguments, unions, nested modules and uncached text
between modules all reproduce the oracle's logits.
"""

import pytest
import torch

from pc_rag import PML, PromptCacheError
from pc_rag.kv.buffers import KVBuffer

from .conftest import ARCHS

SCHEMA = """<schema name="trip">
<system>You plan trips.</system>
<user>
<module name="plan">Plan <param name="days" len="6"/> days of travel.
<union>
<module name="beach">Beaches: Miami, Rio.</module>
<module name="city">Cities: Tokyo, Rome, Paris, Seoul.
<module name="food">Food: ramen, pasta.</module>
</module>
</union>
</module>
<module name="budget">Budget: moderate.</module>
</user>
</schema>"""

PROMPTS = [
    # parameter argument shorter than its slot, second union member, nested module, text between modules
    PML('<prompt schema="trip"><plan days="three"><city><food/></city></plan>and also<budget/><user>Which city first?</user></prompt>'),
    # first union member, no argument, text before the first import
    PML('<prompt schema="trip">Note:<plan><beach/></plan><user>Go?</user></prompt>'),
    # skip a module: what follows it moves (or keeps a gap, for learned positions)
    PML('<prompt schema="trip"><budget/><user>Cost?</user></prompt>'),
    # two imports, a shorter union member, text only after the last module
    PML('<prompt schema="trip"><plan days="two"><beach/></plan><budget/>How much?</prompt>'),
]
# learned positions: modules keep their schema positions, so text before a module would share
# positions with it; such prompts are refused (tests/test_edges.py)
REFUSED_ON_LEARNED = {PROMPTS[0], PROMPTS[1]}


def oracle(engine, plan):
    buffer = KVBuffer.for_model(engine.model, len(plan.input_ids))
    logits = engine.forward(buffer, plan.input_ids, plan.position_ids, logits=True)
    return logits, buffer


def inject_contiguous_kv(engine, schema, plan, buffer):
    """Overwrite each cached segment's stored KV with the oracle's KV for it (moved back to its source position)."""
    start = 0
    for segment in plan.segments:
        if segment.cached:
            kv = buffer.slice(start, start + len(segment)).clone()
            delta = segment.source_position - segment.position
            if delta and engine.rotator is not None:
                engine.rotator.rotate_into(kv[:, 0], kv[:, 0].clone(), delta)
            stored = engine.store.get(schema.keys[segment.owner])
            stored.kv[:, :, :, segment.offset : segment.offset + len(segment)] = kv
        start += len(segment)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_contiguous_modules_reproduce_full_prefill(make_engine, arch, prompt):
    engine = make_engine(arch, encoding="isolated")
    schema = engine.add_schema(SCHEMA, progress=False)
    if arch == "gpt2" and prompt in REFUSED_ON_LEARNED:
        with pytest.raises(PromptCacheError, match="positions must increase"):
            engine.plan(prompt)
        return
    plan = engine.plan(prompt)
    assert plan.cached_tokens > 0 and plan.computed_tokens > 0
    expected, buffer = oracle(engine, plan)
    inject_contiguous_kv(engine, schema, plan, buffer)
    cached = engine.next_token_logits(prompt)
    assert (cached - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_position_kind_is_measured(make_engine, arch):
    engine = make_engine(arch)
    assert engine.position_kind == ("learned" if arch == "gpt2" else "alibi" if arch == "bloom" else "rope")
    assert engine.movable is (arch != "gpt2")


def test_a_rotary_embedding_that_is_not_rope_pins_modules_and_says_so(make_tiny, tokenizer):
    """A rotary embedding whose keys do not move as RoPE (here: angles of the squared position)
    pins modules, and the refusal names it; it was reported as "learned absolute positions"."""
    from pc_rag import PromptCache

    model = make_tiny("llama")
    rotary = model.model.rotary_emb
    original = rotary.forward
    rotary.forward = lambda x, position_ids, *args, **kwargs: original(x, position_ids**2, *args, **kwargs)
    engine = PromptCache(model, tokenizer)
    assert engine.position_kind == "rope_unrecognised" and not engine.movable
    with pytest.raises(PromptCacheError, match="a rotary embedding whose keys do not move as RoPE"):
        engine.add_documents(["Harbour 1 handles 11 ships a day."], progress=False)


def test_learned_positions_keep_schema_positions(make_engine):
    engine = make_engine("gpt2")
    engine.add_schema(SCHEMA, progress=False)
    plan = engine.plan(PROMPTS[2])
    cached = [s for s in plan.segments if s.cached]
    assert all(s.position == s.source_position for s in cached)
    assert plan.position_ids != list(range(len(plan.input_ids)))  # the skipped module leaves a gap


def assert_moved_keys_equal_keys_encoded_there(engine, tokenizer) -> None:
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
    at_zero = engine.forward.keys_at(ids, 0)
    in_place = engine.forward.keys_at(ids, 123)
    moved = torch.empty_like(at_zero)
    engine.rotator.rotate_into(moved, at_zero, 123)
    assert (moved - in_place).abs().max().item() <= 1e-5
    assert (at_zero - in_place).abs().max().item() > 1e-3  # the move really changed the keys


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}])
def test_moved_rope_keys_equal_keys_encoded_in_place(make_tiny, tokenizer, arch, rope):
    from pc_rag import PromptCache

    overrides = {"rope_parameters": rope} if rope else {}
    engine = PromptCache(make_tiny(arch, **overrides), tokenizer)
    assert engine.position_kind == "rope"
    if rope:
        assert engine.rotator.scaling != 1.0  # YaRN's attention factor is really in play
    assert_moved_keys_equal_keys_encoded_there(engine, tokenizer)


@pytest.mark.parametrize("arch", ["gemma3", "smollm3", "cohere2", "llama4"])
def test_layers_that_differ_in_rope_rotate_by_their_own_frequencies(make_tiny, tokenizer, arch):
    # Gemma 3 crashed here (its rotary module holds one frequency set per layer type, no inv_freq);
    # SmolLM3's layer without RoPE, and Cohere 2's as well as its interleaved pairs of dims, made
    # the whole model measure as "learned" (modules pinned, documents refused)
    from pc_rag import PromptCache

    engine = PromptCache(make_tiny(arch), tokenizer)
    frequencies = engine.rotator.inv_freq
    assert engine.position_kind == "rope" and engine.rotator.per_layer
    if arch == "gemma3":  # layer 1 is global (theta 1e6), layers 0 and 2 local (1e4)
        assert torch.equal(frequencies[0], frequencies[2]) and not torch.equal(frequencies[0], frequencies[1])
    elif arch == "smollm3":  # layer 1 has no RoPE
        assert frequencies[0].any() and not frequencies[1].any()
    else:  # layers 0-2 (sliding window, or chunked) rotate neighbouring dims together; layer 3 (global) has no RoPE
        assert engine.rotator.interleaved and all(f.any() for f in frequencies[:3]) and not frequencies[3].any()
    assert_moved_keys_equal_keys_encoded_there(engine, tokenizer)


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_single_module_is_exact(make_engine, arch):
    engine = make_engine(arch, encoding="shared_prefix")
    engine.add_schema(
        '<schema name="doc"><system>Answer from the document.</system><user><module name="d">The sky is blue because of Rayleigh scattering.</module></user></schema>',
        progress=False,
    )
    prompt = PML('<prompt schema="doc"><d/><user>Why is the sky blue?</user></prompt>')
    cached = engine.next_token_logits(prompt)
    full = engine.next_token_logits(prompt, use_cache=False)
    assert (cached - full).abs().max().item() <= 1e-4
    a = engine.generate(prompt, max_new_tokens=8)
    b = engine.generate(prompt, max_new_tokens=8, use_cache=False)
    assert a.token_ids == b.token_ids
    assert a.stats.cached_tokens > 0 and b.stats.cached_tokens == 0


def test_isolated_encoding_differs_from_full_prefill_when_modules_see_no_prefix(make_engine):
    """Sanity check of the test above: without the shared prefix the approximation is visible."""
    engine = make_engine("llama", encoding="isolated")
    engine.add_schema('<schema name="doc">Context first. <module name="d">The sky is blue.</module></schema>', progress=False)
    prompt = PML('<prompt schema="doc"><d/> Why?</prompt>')
    diff = (engine.next_token_logits(prompt) - engine.next_token_logits(prompt, use_cache=False)).abs().max().item()
    assert diff > 1e-4


def test_llama4_runs_its_decoder_stack_and_serves_within_its_attention_chunk(make_tiny, tokenizer):
    """Llama 4's causal LM names its stack by a prefix it does not have ("language_model"):
    ``model.base_model`` was the whole LM, so its RoPE went unfound (modules pinned as "learned
    absolute positions") and every encoding pass computed logits for every token. Its chunked
    attention (and query temperature) pc-rag does not reproduce past one chunk: a prompt past it
    is refused, naming why, instead of answered differently from the model."""
    from pc_rag import PromptCache

    engine = PromptCache(make_tiny("llama4", attention_chunk_size=96), tokenizer)
    assert engine.forward.decoder is engine.model.model and engine.movable
    assert engine.context_window == 96 and "chunked attention (96-token chunks)" in engine.spec.context_reason
    within = PML('<prompt schema="doc"><d/><user>Why?</user></prompt>')
    engine.add_schema('<schema name="doc"><system>Answer.</system><user><module name="d">' + "The sky is blue. " * 3
                      + "</module></user></schema>", progress=False)
    plan = engine.plan(within)
    full = engine.model(input_ids=torch.tensor([plan.input_ids]), position_ids=torch.tensor([plan.position_ids])).logits[0, -1]
    assert (engine.next_token_logits(within, use_cache=False) - full).abs().max().item() <= 1e-4  # the model's own answer
    with pytest.raises(PromptCacheError, match="more than the model's context window \\(96\\): chunked attention"):
        engine.generate(PML('<prompt schema="doc"><d/><user>' + "Why is that so? " * 20 + '</user></prompt>'), max_new_tokens=2)
    tuned = PromptCache(make_tiny("llama4", attn_temperature_tuning=True, floor_scale=64, attention_chunk_size=512), tokenizer)
    assert tuned.context_window == 63 and "query temperature tuning from position 63 on" in tuned.spec.context_reason


def test_llama4_as_published_runs_its_language_model_for_text(tokenizer):
    """Llama 4's checkpoints are image-and-text models (``Llama4ForConditionalGeneration``),
    whose own forward fails without images in transformers 5.x (it reads ``image_outputs`` from
    its language model's output): every pass pc-rag ran raised AttributeError. Text is its
    language model's alone, so that is what runs, and cached prompts equal it."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from pc_rag import PromptCache

    from .conftest import tiny_config

    torch.manual_seed(0)
    vocab = len(tokenizer)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
                  vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = Llama4Config(text_config=tiny_config("llama4", vocab).to_dict(), vision_config=vision, image_token_index=vocab - 1)
    model = Llama4ForConditionalGeneration(config).eval()
    engine = PromptCache(model, tokenizer, recompute=0, attention_temperature=1.0, attention_scale=1.0, encoding="isolated")
    assert engine.position_kind == "rope" and engine.movable
    schema = engine.add_schema(SCHEMA, progress=False)
    for prompt in PROMPTS:
        plan = engine.plan(prompt)
        expected, buffer = oracle(engine, plan)
        with torch.no_grad():
            own = model.language_model(input_ids=torch.tensor([plan.input_ids]),
                                       position_ids=torch.tensor([plan.position_ids])).logits[0, -1]
        assert (own - expected).abs().max().item() <= 1e-4
        inject_contiguous_kv(engine, schema, plan, buffer)
        assert (engine.next_token_logits(prompt) - expected).abs().max().item() <= 1e-4
    assert engine.generate(PROMPTS[0], max_new_tokens=3, do_sample=False).token_ids


def not_supported(name: str, vocab: int):
    """Tiny models pc-rag refuses: (config, what the refusal says)."""
    from transformers import DeepseekV3Config, Lfm2Config, MambaConfig, Qwen3NextConfig

    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if name == "deepseek_v3":  # keys (rotary and not) and values of other sizes than head_dim
        return DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=128, num_hidden_layers=2, kv_lora_rank=16,
                                q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
                                n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                                topk_group=1), "deepseek_v3 uses multi-head latent attention \\(keys of 16 dims, 8 of them rotary"
    if name == "qwen3_next":
        return Qwen3NextConfig(**common, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                               layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2, linear_num_key_heads=2,
                               linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2), "qwen3_next has layers of type 'linear_attention': their state depends"
    if name == "lfm2":
        return Lfm2Config(**common, num_hidden_layers=2, layer_types=["conv", "full_attention"]), "lfm2 has layers of type 'conv'"
    return MambaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, state_size=4, expand=1), "mamba has no attention heads"


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_next", "lfm2", "mamba"])
def test_a_model_without_reusable_attention_kv_is_refused_by_name(tokenizer, name):
    """Multi-head latent attention (DeepSeek V3: the KV buffer's first write failed deep inside
    transformers with a shape mismatch), layers whose state sums up all text before it (Qwen3-Next's
    linear attention, LFM2's convolutions: "Cannot get conv state"), no attention at all (Mamba:
    an AttributeError): each refused when the engine is built, saying why."""
    from transformers import AutoModelForCausalLM

    from pc_rag import PromptCache

    config, says = not_supported(name, len(tokenizer))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with pytest.raises(PromptCacheError, match=says):
        PromptCache(model, tokenizer)


def test_a_multimodal_model_runs_its_text_stack_and_moves_modules_exactly(tokenizer):
    """Gemma 3's checkpoints load through AutoModelForCausalLM as an image-and-text model
    (``Gemma3ForConditionalGeneration``) whose ``base_model`` holds the text stack one level
    down: its RoPE went unfound, modules were pinned as "learned absolute positions", and
    prompts that skip a module left gaps that the model's own forward reads otherwise (0.4 apart
    in logits). Found, modules move, and cached prompts equal the model."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    from pc_rag import PromptCache

    from .conftest import tiny_config

    torch.manual_seed(0)
    vocab = len(tokenizer)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    config = Gemma3Config(text_config=tiny_config("gemma3", vocab).to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    settings = dict(recompute=0, attention_temperature=1.0, attention_scale=1.0, encoding="isolated")
    assert PromptCache(model, tokenizer, **settings).position_kind == "rope"
    for prompt in PROMPTS:
        engine = PromptCache(model, tokenizer, **settings)
        schema = engine.add_schema(SCHEMA, progress=False)
        plan = engine.plan(prompt)
        expected, buffer = oracle(engine, plan)
        with torch.no_grad():
            own = model(input_ids=torch.tensor([plan.input_ids]), position_ids=torch.tensor([plan.position_ids])).logits[0, -1]
        assert (own - expected).abs().max().item() <= 1e-4  # pc-rag's pass is the model's
        inject_contiguous_kv(engine, schema, plan, buffer)
        assert (engine.next_token_logits(prompt) - expected).abs().max().item() <= 1e-4
