"""``weights="float16"``: linear layers packed in fp16 with float32 arithmetic (FBGEMM), exact on
every path, fingerprinted apart from float32, and the embedded model's default on a CPU."""

from __future__ import annotations

import pytest
import torch

from pc_rag import PromptCache, PromptCacheError
from pc_rag.kernels import loader
from pc_rag.weights import choice as weights
from pc_rag.weights.float16 import Float16Linear

from .conftest import assert_answers_as_float32


def test_a_float16_layer_multiplies_its_weight_rounded_to_fp16_in_float32():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=True)
    layer = Float16Linear(linear)
    rounded = linear.weight.detach().half().float()
    assert torch.equal(layer.dequantized(), rounded) and not torch.equal(rounded, linear.weight)
    for x in (torch.randn(1, 96), torch.randn(3, 7, 96), torch.randn(0, 96)):
        expected = torch.nn.functional.linear(x, rounded, linear.bias)
        out = layer(x)
        assert out.dtype == torch.float32 and out.shape == expected.shape
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(PromptCacheError, match="float32 inputs"):
        layer(torch.randn(2, 96, dtype=torch.bfloat16))
    with torch.no_grad():
        linear.bias[0] += 1.0
    assert not torch.equal(Float16Linear(linear).digest, layer.digest)  # the bias is part of what is fingerprinted


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_float16_engine_is_exact_on_every_path(make_tiny, tokenizer, arch):
    model = make_tiny(arch)
    engine = PromptCache(model, tokenizer, weights="float16")
    assert engine.weights == "float16" and engine.quantized_layers == 2 * 7 + 1  # 7 projections a layer and the head
    assert isinstance(model.lm_head, Float16Linear) and not any(type(m) is torch.nn.Linear for m in model.modules())
    report = engine.check(fidelity=False)  # cached against full prefill, batches, joins: all on the same fp16 weights
    assert report.exact, str(report)


def test_float16_weights_are_fingerprinted_apart_from_float32_and_alike_between_copies(make_tiny, tokenizer):
    """Module KV computed in fp16 is never served to a float32 engine of the same checkpoint (the
    fingerprint hashes the fp16 values' digest), and two fp16 engines of it share KV."""
    as_loaded = PromptCache(make_tiny("llama"), tokenizer).fingerprint
    first = PromptCache(make_tiny("llama"), tokenizer, weights="float16").fingerprint
    second = PromptCache(make_tiny("llama"), tokenizer, weights="float16").fingerprint
    other = PromptCache(make_tiny("llama", seed=1), tokenizer, weights="float16").fingerprint
    assert first == second and first != as_loaded and first != other


def test_float16_refuses_what_it_cannot_run(make_tiny, tokenizer):
    with pytest.raises(PromptCacheError, match="runs eagerly"):
        PromptCache(make_tiny("llama"), tokenizer, weights="float16", compile=True)
    with pytest.raises(PromptCacheError, match="float32 model on a CPU; this one is torch.bfloat16"):
        PromptCache(make_tiny("llama").to(torch.bfloat16), tokenizer, weights="float16")
    with pytest.raises(PromptCacheError, match="weights must be one of float32, float16, int4, int4-a8, got 'fp8'"):
        PromptCache(make_tiny("llama"), tokenizer, weights="fp8")


def test_only_a_gguf_model_defaults_to_4_bits_and_only_eagerly_on_a_cpu_at_its_own_dtype(tmp_path, monkeypatch):
    assert weights.chosen(None, from_gguf=True, device="cpu") == "int4"  # its GGUF's own blocks, on pc-rag's kernels
    assert weights.chosen(None, from_gguf=True, dtype=torch.bfloat16, device="cpu") is None  # a dtype asked for: as loaded
    assert weights.chosen(None, from_gguf=True, device="cpu", compile=True) is None
    assert weights.chosen(None, from_gguf=True, device="meta") is None
    assert weights.chosen(None, from_gguf=False, device="cpu") is None  # a user's checkpoint: as loaded
    assert weights.chosen("int4", from_gguf=True, device="cpu") == "int4"
    assert weights.chosen("float32", from_gguf=True, device="cpu") == "float32"
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))  # where pc-rag's kernels cannot be built: fp16
    monkeypatch.setenv("PC_RAG_KERNELS", "build")  # (no library from the install either)
    monkeypatch.setenv("PC_RAG_HOME", str(tmp_path))
    loader.forget()
    try:
        assert weights.chosen(None, from_gguf=True, device="cpu") == "float16"
    finally:
        loader.forget()


def test_the_embedded_model_in_float16_answers_as_in_float32():
    """fp16 weights against the checkpoint as loaded: the same greedy answer and a first-token KL
    near zero, cached and by full prefill."""
    fp16 = PromptCache.from_pretrained(weights="float16")
    assert fp16.weights == "float16" and isinstance(fp16.model.lm_head, Float16Linear)
    assert_answers_as_float32(fp16, 1e-4, 12)
