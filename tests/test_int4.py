"""``weights="int4"``: linear layers in 4 bits on a CPU (torch's int4 kernel), read back as the GGUF
Q4_1 values they were made from, and exact on every path like any other weights."""

from __future__ import annotations

import pytest
import torch

from pc_rag import PromptCache, PromptCacheError
from pc_rag.model.int4 import GROUP, Int4Linear


def test_q4_1_blocks_are_read_back_as_their_own_values():
    """A Q4_1 block is d * q + m with q from 0 to 15 (its minimum and maximum): quantized again, each
    value's q is recovered exactly, and the weight only moves by bf16's rounding of d and m."""
    torch.manual_seed(0)
    out_features, in_features = 64, 4 * GROUP
    q = torch.randint(0, 16, (out_features, in_features // GROUP, GROUP))
    q[..., 0], q[..., 1] = 0, 15  # every block spans its range, as Q4_1's quantizer makes it
    d = torch.rand(out_features, in_features // GROUP, 1).half().float() * 0.02 + 1e-3
    m = (torch.rand(out_features, in_features // GROUP, 1).half().float() - 0.5) * 0.2
    weight = (d * q + m).reshape(out_features, in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        linear.weight.copy_(weight)
    layer = Int4Linear(linear)
    served = layer.dequantized().reshape(out_features, in_features // GROUP, GROUP)
    assert torch.equal(((served - m) / d).round().long(), q)
    assert (served.reshape_as(weight) - weight).abs().max() <= (15 * d + m.abs()).max() * 2**-7
    x = torch.randn(3, in_features)
    expected = torch.nn.functional.linear(x.bfloat16().float(), served.reshape_as(weight), linear.bias)
    assert (layer(x) - expected).abs().max() <= 0.05 * expected.abs().max()


def test_an_int4_engine_is_exact_on_every_path(make_tiny, tokenizer):
    model = make_tiny("llama")
    engine = PromptCache(model, tokenizer, weights="int4")
    assert engine.int4_layers == 2 * 7 + 1 and isinstance(model.lm_head, Int4Linear)  # 7 projections a layer, and the head
    report = engine.check(fidelity=False)  # cached against full prefill, batches, joins: all on the same 4-bit weights
    assert report.exact, str(report)


def test_weights_that_are_not_offered_are_refused(make_tiny, tokenizer):
    with pytest.raises(PromptCacheError, match="weights must be one of float32, int4"):
        PromptCache(make_tiny("llama"), tokenizer, weights="int3")
