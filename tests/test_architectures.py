"""Architectures that went silently wrong in batches or failed at decode: each served exactly on
every path pc-rag runs it by (rows of a batch sharing a moved module, a request joining a running
one, decode steps), or refused when the engine is built, saying why.

Tiny random checkpoints built as ``AutoModelForCausalLM`` builds them, their norm weights and
biases drawn away from their defaults so that a skipped layer or a wrong rotation shows.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pc_rag import PromptCache, PromptCacheError, build_prompt

from .conftest import drawn_away, staggered

# (config, what the engine logs when it serves the model without split attention, or None)
FAMILIES = ("stablelm", "nemotron", "falcon", "exaone4", "diffllama", "doge", "jetmoe", "phimoe", "gptj", "codegen")


def family_config(name: str, vocab: int):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if name == "stablelm":  # its decoder layer does not pass **kwargs to its attention
        return transformers.StableLmConfig(**common)
    if name == "nemotron":  # nor does Nemotron's
        return transformers.NemotronConfig(**{**common, "head_dim": 16})
    if name == "falcon":  # the 7B layout: one KV head, named by `multi_query`, not `num_key_value_heads`
        return transformers.FalconConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                                         new_decoder_architecture=False, alibi=False, bos_token_id=None, eos_token_id=None)
    if name == "exaone4":  # global layers pass sliding_window=None, local ones a window of 8
        return transformers.Exaone4Config(**{**common, "num_hidden_layers": 4, "sliding_window": 8,
                                             "layer_types": ["sliding_attention", "full_attention"] * 2})
    if name == "diffllama":  # two attention calls per layer, on transformed values
        return transformers.DiffLlamaConfig(**common)
    if name == "doge":  # a mask per head, computed from the values
        return transformers.DogeConfig(**common)
    if name == "jetmoe":  # its keys repeated to every query head before attention
        return transformers.JetMoeConfig(**{**common, "kv_channels": 16, "num_local_experts": 4, "num_experts_per_tok": 2})
    if name == "phimoe":  # windowed masks, while its attention is told no window
        return transformers.PhimoeConfig(**{**common, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2})
    if name in ("gptj", "codegen"):  # RoPE on interleaved pairs of the first 8 dims, from a table of sin and cos
        return (transformers.GPTJConfig if name == "gptj" else transformers.CodeGenConfig)(
            vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=1024, bos_token_id=None, eos_token_id=None)
    raise ValueError(name)


def tiny(name: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return drawn_away(AutoModelForCausalLM.from_config(family_config(name, vocab), dtype=torch.float32).eval())


def _max_diff(first, second) -> float:
    return max((a - b).abs().max().item() for x, y in zip(first, second) for a, b in zip(x.logits, y.logits))


@pytest.mark.parametrize("name", FAMILIES)
def test_every_path_equals_lone_requests(tokenizer, name, caplog):
    """Before: StableLM's and Nemotron's batch rows differed from lone requests by up to 3.8 and
    6.9 in logits, and a running request's tokens changed when another joined; Falcon failed at
    its first decode step; EXAONE 4's global layers attended through a window in shared batches;
    DiffLlama's batch rows were wrong and its fused step raised; Doge's batch raised (a mask per
    head) and so did JetMoE's (keys repeated to the query heads); PhiMoE's shared parts were read
    without the window its masks have; GPT-J's and CodeGen's documents could not move."""
    with caplog.at_level(logging.WARNING, logger="pc_rag.model.spec"):
        engine = PromptCache(tiny(name, len(tokenizer)), tokenizer, recompute=0, attention_temperature=1.0, attention_scale=1.0)
    if name in ("stablelm", "nemotron", "diffllama", "doge", "jetmoe"):  # proved by the sentinel pass: one log line says why
        assert not engine.split and "served without shared-module attention" in caplog.text
    if name in ("gptj", "codegen"):  # before: pinned as rope_unrecognised (their rotary module holds no frequencies)
        assert engine.position_kind == "rope" and engine.movable and engine.split
    names = engine.add_documents(["The ferry leaves at nine from the north pier.", "Tickets cost five euros at the kiosk.",
                                  "The museum opens at ten."], progress=False)
    prompts = [build_prompt(question, [names[1], names[0]]) for question in ("When?", "How much does it cost?", "Where?")]
    settings = dict(max_new_tokens=6, output_logits=True)
    lone = [engine.generate(prompt, **settings) for prompt in prompts]
    assert _max_diff(lone, engine.generate_batch(prompts, **settings)) <= 1e-3
    joined = staggered(engine, prompts, **settings)  # each joins the running ones after their first token
    assert _max_diff(lone, joined) <= 1e-3 and [r.token_ids for r in joined] == [r.token_ids for r in lone]


@pytest.mark.parametrize("name", FAMILIES)
def test_scored_recovery_runs_or_is_refused_when_the_engine_is_built(tokenizer, name):
    """Before: ``recovery="query"`` on StableLM and Nemotron raised a bare AssertionError mid-request."""
    model = tiny(name, len(tokenizer))
    try:
        engine = PromptCache(model, tokenizer, recovery="query", recovery_budget=0.2)
    except PromptCacheError as err:
        assert "recovery" in str(err)
        return
    names = engine.add_documents(["The ferry leaves at nine.", "Tickets cost five euros."], progress=False)
    assert engine.generate(build_prompt("When?", names), max_new_tokens=3).token_ids


def test_per_layer_head_sizes_are_refused_when_the_engine_is_built(tokenizer):
    """Gemma 4's global layers have larger heads: transformers' AmbiguousGlobalPerLayerAttributeError escaped."""
    config = transformers.Gemma4TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                                           pad_token_id=None, bos_token_id=None, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(PromptCacheError, match="head_dim per layer \\(16, 512\\)"):
        PromptCache(model, tokenizer)


def test_layers_that_cache_no_kv_of_their_own_are_refused_when_the_engine_is_built(tokenizer):
    """Gemma 3n's last layers read an earlier layer's KV: their slots in pc-rag's buffers were never
    written, so the position probe compared uninitialised memory and measured another position kind
    in each process (documents accepted in one, refused in the next)."""
    vocab = len(tokenizer)
    config = transformers.Gemma3nTextConfig(
        vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, hidden_size_per_layer_input=8, laurel_rank=4,
        activation_sparsity_pattern=[0.0] * 4, altup_num_inputs=2, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(PromptCacheError, match="layers 2, 3 cache no KV of their own"):
        PromptCache(model, tokenizer)


def test_a_decoder_that_places_positions_by_its_cache_length_is_refused(tokenizer):
    """BART's decoder (``BartForCausalLM``) ignores the position ids it is given: the probe saw keys
    that do not move and served it as position-free, while a moved module kept the positions it was
    encoded at (the checks passed, since pc-rag's full prefill went through the same buffers)."""
    config = transformers.BartConfig(vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(PromptCacheError, match="does not place tokens at the position ids it is given"):
        PromptCache(model, tokenizer)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_an_encoder_loaded_as_a_causal_lm_is_refused(tokenizer, is_decoder):
    """RoBERTa as ``RobertaForCausalLM``: without ``is_decoder`` it attends both ways (a cached
    prefix is not what it computes); with it, its embeddings number positions from its padding id
    + 1 where pc-rag numbers them from 0 (its full prefill differed from its own forward by 0.24)."""
    config = transformers.RobertaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=1024, is_decoder=is_decoder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(PromptCacheError, match="does not number positions from 0" if is_decoder else "is not causal"):
        PromptCache(model, tokenizer)
