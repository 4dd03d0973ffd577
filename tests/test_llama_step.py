"""The written-out decode step of Llama-family models (``pc_rag.forward.llama_step``): the logits of
the model's own step, on every decode path, and never used where it would not be."""

from __future__ import annotations

import pytest
import torch

from pc_rag import PromptCache
from pc_rag.forward.llama_step import disagreement, unsupported
from pc_rag.prompt.documents import build_prompt
from tests.conftest import drawn_away, staggered

DOCUMENTS = ["The Denver Broncos won Super Bowl 50 against the Carolina Panthers.",
             "The game was played on February 7, 2016, at Levi's Stadium.",
             "Lady Gaga sang the national anthem before the game."]


def logprobs(generation) -> torch.Tensor:
    """Each token's log-probability and its top two alternatives', ``[tokens, 3]``."""
    return torch.tensor([[entry.logprob, *(p for _, p in entry.top)] for entry in generation.logprobs])


def engine_for(make_tiny, tokenizer, arch: str, **overrides) -> PromptCache:
    return PromptCache(drawn_away(make_tiny(arch, **overrides)), tokenizer, recompute=0, attention_temperature=1.0,
                       attention_scale=1.0)


QUESTIONS = ["Who won?", "When was the game played, and where?", "Who sang?"]


def answers(engine: PromptCache, written: bool) -> list:
    """Greedy answers with their logprobs: one request alone; three arriving while the others
    decode (rows at different lengths: the CPU's by-extents attention), their documents in three
    orders; and three over the same documents in the same order (rows that read them shared)."""
    step = engine.forward.written_step
    engine.forward.written_step = step if written else None
    try:
        ids = engine.add_documents(DOCUMENTS, progress=False)
        settings = dict(max_new_tokens=12, logprobs=2)
        alone = engine.generate(build_prompt(QUESTIONS[0], ids), **settings)
        rotated = staggered(engine, [build_prompt(q, ids[i:] + ids[:i]) for i, q in enumerate(QUESTIONS)], **settings)
        together = engine.generate_batch([build_prompt(q, ids) for q in QUESTIONS], **settings)
        return [alone, *rotated, *together]
    finally:
        engine.forward.written_step = step


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8}), ("qwen3", {}),
                                            ("olmo2", {}), ("granite", {}), ("gemma3", {}), ("gemma3", {"final_logit_softcapping": 2.0}), ("phi3", {}),
                                            ("gemma2", {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0}), ("smollm3", {})],
                         ids=["llama", "qwen2-biases", "mistral-window", "qwen3-head-norms", "olmo2-norms-after", "granite-multipliers",
                              "gemma3-local-and-global", "gemma3-soft-capped-logits", "phi3-joined-projections",
                              "gemma2-soft-capped-scores-eager", "smollm3-a-layer-without-rope"])
def test_the_written_step_answers_as_the_model_does(make_tiny, tokenizer, arch, overrides):
    engine = engine_for(make_tiny, tokenizer, arch, **overrides)
    step = engine.forward.written_step
    assert step is not None, "a Llama-family model decodes written out"
    assert disagreement(step, engine.forward._model_step, engine.model, split=engine.spec.split) == 0.0
    # the proof covered extents and shared KV; Gemma 2 runs eager attention (SDPA cannot cap its scores), which reads neither
    assert engine.spec.split == (arch != "gemma2")
    written, own = answers(engine, True), answers(engine, False)
    assert step.shared_steps > 0 or step.windowed  # the batch over the same documents read them shared
    for a, b in zip(written, own):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 12
        assert torch.allclose(logprobs(a), logprobs(b), atol=1e-5)


def test_the_embedded_model_decodes_written_out_as_its_own_step(smollm):
    step = smollm.forward.written_step
    assert step is not None and type(smollm.model).__name__ == "LlamaForCausalLM"
    prompt = build_prompt("Who won Super Bowl 50?", smollm.add_documents(DOCUMENTS, progress=False))
    smollm.forward.written_step = None
    try:
        own = smollm.generate(prompt, max_new_tokens=16)
    finally:
        smollm.forward.written_step = step
    written = smollm.generate(prompt, max_new_tokens=16)
    assert written.token_ids == own.token_ids


def test_other_families_keep_the_models_own_step(make_tiny, tokenizer):
    for arch in ("cohere", "qwen3_moe"):  # LayerNorm, attention and MLP side by side; experts
        engine = PromptCache(make_tiny(arch), tokenizer)
        assert engine.forward.written_step is None
        assert "not one of LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer" in unsupported(engine.model)
    assert unsupported(make_tiny("gpt2")) == "its decoder has no layer list"
    gelu = make_tiny("llama", hidden_act="gelu")
    assert unsupported(gelu) == "its MLP activation is 'gelu', not 'silu' or 'gelu_pytorch_tanh'"
    assert PromptCache(gelu, tokenizer).forward.written_step is None
    assert unsupported(make_tiny("phi3", partial_rotary_factor=0.5)) == "RoPE turns 0.5 of each head's dims, not all"


def test_a_hooked_model_is_run_by_its_own_forward(make_tiny, tokenizer):
    """A forward hook on a decoder layer (a steering vector) changes what the layer returns, which a
    written-out step would skip: present at build, the step is refused by its proof; added later,
    steps go back to the model while it is there."""
    steer = torch.randn(64, generator=torch.Generator().manual_seed(2))

    def hook(module, args, output):
        return output + steer

    model = drawn_away(make_tiny("llama"))
    handle = model.model.layers[1].register_forward_hook(hook)
    assert PromptCache(model, tokenizer).forward.written_step is None  # its proof saw the hook's effect
    handle.remove()

    engine = engine_for(make_tiny, tokenizer, "llama")
    assert engine.forward.written_step is not None and not engine.forward.written_step.hooked
    prompt = build_prompt("Who won?", engine.add_documents(DOCUMENTS, progress=False))
    handle = engine.model.model.layers[1].register_forward_hook(hook)
    try:
        assert engine.forward.written_step.hooked
        steered = engine.generate(prompt, max_new_tokens=12, logprobs=2)
        engine.forward.written_step, step = None, engine.forward.written_step
        own = engine.generate(prompt, max_new_tokens=12, logprobs=2)
        engine.forward.written_step = step
    finally:
        handle.remove()
    plain = engine.generate(prompt, max_new_tokens=12, logprobs=2)
    assert steered.token_ids == own.token_ids and torch.allclose(logprobs(steered), logprobs(own), atol=1e-5)
    assert not torch.allclose(logprobs(steered), logprobs(plain))  # the hook did change the steps it was there for
