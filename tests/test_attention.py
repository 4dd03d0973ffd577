"""The registered ``pc_rag_sdpa`` kernel computes what transformers' ``sdpa`` computes."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pc_rag.forward import attention
from pc_rag.forward.forward import cache_keyword


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pc_rag_sdpa_matches_sdpa_with_mask_and_gqa(make_tiny, arch):
    model = make_tiny(arch, seed=3)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # GQA: the path we replace
    ids = torch.randint(5, 1000, (1, 40))

    def run() -> torch.Tensor:
        # a prefix in the cache, then a multi-token query: the shape of a cached prompt's prefill
        cache = {cache_keyword(model): DynamicCache(config=model.config)}
        with torch.no_grad():
            model(ids[:, :25], use_cache=True, **cache)
            return model(ids[:, 25:], use_cache=True, **cache).logits

    model.set_attn_implementation("sdpa")
    reference = run()
    assert attention.install(model)
    assert model.config._attn_implementation == attention.ATTENTION_NAME
    got = run()
    assert (got - reference).abs().max().item() <= 1e-5


def test_install_leaves_eager_models_alone(make_tiny):
    model = make_tiny("llama")
    model.set_attn_implementation("eager")
    assert not attention.install(model)
    assert model.config._attn_implementation == "eager"


def test_engine_installs_kernel(make_engine):
    engine = make_engine("llama")
    assert engine.model.config._attn_implementation == attention.ATTENTION_NAME
