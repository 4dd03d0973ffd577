"""Linear layers in 4 bits on torch's int4 kernel (``weights="int4"`` where pc-rag's own kernels
cannot be built: tests/test_blocks.py), read back as the GGUF Q4_1 values they were made from,
and exact on every path like any other weights."""

from __future__ import annotations

import pytest
import torch

from pc_rag import PromptCache, PromptCacheError
from pc_rag.weights import int4
from pc_rag.weights.int4 import FLOAT_ROWS, GROUP, Int4Linear, Int8Linear

from .conftest import assert_same_logits_joined_and_apart


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
    assert int4.install(model, "int4") == 2 * 7 + 1 and isinstance(model.lm_head, Int8Linear)  # 7 projections a layer in 4 bits, the head in 8
    report = PromptCache(model, tokenizer).check(fidelity=False)  # cached against full prefill, batches, joins: all on the same 4-bit weights
    assert report.exact, str(report)


def test_wide_inputs_multiply_the_kept_float_weights_and_narrow_ones_the_4_bit_ones():
    torch.manual_seed(0)
    linear = torch.nn.Linear(4 * GROUP, 48)
    both, packed = Int4Linear(linear, keep_float=True), Int4Linear(linear)
    values = both.float_weight  # the 4-bit values in float32: what the kernel multiplies by
    assert torch.equal(values.bfloat16(), both.dequantized().bfloat16()) and not torch.equal(values, linear.weight)
    prefill, batch, narrow = torch.randn(2, 20, 4 * GROUP), torch.randn(FLOAT_ROWS, 4 * GROUP), torch.randn(FLOAT_ROWS - 1, 4 * GROUP)
    assert torch.equal(both(prefill), torch.nn.functional.linear(prefill, values, linear.bias))
    float_batch = torch.nn.functional.linear(batch, values, linear.bias)  # as W @ x^T (pc_rag.weights.small_batch): another summation order
    assert not torch.equal(both(batch), packed(batch)) and torch.allclose(both(batch), float_batch, rtol=1e-5, atol=1e-6)
    assert torch.equal(both(narrow), packed(narrow))
    # the two widths multiply the same weights: they differ by the kernel's bf16 activations only
    float_narrow = torch.nn.functional.linear(narrow, values, linear.bias)
    assert (both(narrow) - float_narrow).abs().max() <= 2**-7 * float_narrow.abs().max()


def test_an_int4_engine_that_prefills_in_float32_is_exact_on_every_path(make_tiny, tokenizer):
    """Decode steps and short recomputed passes in 4 bits, prompts in float32: cached and full prefill
    still agree on every path, as each runs the same layers at the same widths."""
    model = make_tiny("llama")
    assert int4.install(model, "int4", keep_float=True) == 2 * 7 + 1
    assert model.model.layers[0].mlp.down_proj.float_weight is not None
    report = PromptCache(model, tokenizer).check(fidelity=False)
    assert report.exact, str(report)


def test_weights_that_are_not_offered_are_refused(make_tiny, tokenizer):
    with pytest.raises(PromptCacheError, match="weights must be one of float32, float16, int4"):
        PromptCache(make_tiny("llama"), tokenizer, weights="int3")


def test_layers_handed_the_same_input_share_one_product(make_tiny, tokenizer):
    """q, k and v (and gate and up) multiply one joined 4-bit weight: the model's logits stay
    bitwise what the layers give apart, in a prompt pass and in decode steps. Where torch's kernel
    sums a joined product in another order than its parts (on an AVX-512 BF16 CPU it does), the
    install's proof keeps the layers apart instead."""
    apart, joined = make_tiny("llama"), make_tiny("llama")
    int4.install(apart, "int4", keep_float=False)
    for layer in apart.modules():
        if isinstance(layer, Int4Linear) and layer.siblings is not None:
            layer.siblings.undo()
    parts = [apart.model.layers[0].self_attn.q_proj, apart.model.layers[0].self_attn.k_proj, apart.model.layers[0].self_attn.v_proj]
    x = torch.randn(4, parts[0].in_features)
    whole = int4.int4_product(x, torch.cat([p.packed for p in parts]), torch.cat([p.scales_and_zeros for p in parts], dim=1), None)
    kernel_joins_bitwise = torch.equal(whole, torch.cat([p(x) for p in parts], dim=-1))
    int4.install(joined, "int4", keep_float=False)
    attention, mlp = joined.model.layers[0].self_attn, joined.model.layers[0].mlp
    assert all(layer.siblings is None for layer in apart.modules() if isinstance(layer, Int4Linear))
    if kernel_joins_bitwise:
        assert attention.q_proj.siblings is attention.k_proj.siblings is attention.v_proj.siblings is not None
        assert mlp.gate_proj.siblings is mlp.up_proj.siblings is not None
        assert attention.o_proj.siblings is None and mlp.down_proj.siblings is None and isinstance(joined.lm_head, Int8Linear)
        assert attention.k_proj.packed.data_ptr() > attention.q_proj.packed.data_ptr()  # views of the joined rows
    else:
        assert all(layer.siblings is None for layer in joined.modules() if isinstance(layer, Int4Linear))
    assert_same_logits_joined_and_apart(joined, apart, tokenizer)


def test_the_output_projection_is_held_in_8_bits_a_row():
    """One scale per output row, |q| <= 127: every weight within half a step of its row's scale."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(4 * GROUP, 96, bias=True)
    head = Int8Linear(linear)
    held = head.packed.float() * head.scales.float()[:, None]
    assert head.packed.dtype == torch.int8 and head.packed.abs().max() <= 127
    assert ((held - linear.weight).abs() <= head.scales.float()[:, None] * 0.5 + 1e-7).all()
    x = torch.randn(5, 4 * GROUP)
    expected = torch.nn.functional.linear(x.bfloat16().float(), held, linear.bias)
    assert (head(x) - expected).abs().max() <= 0.02 * expected.abs().max()
