"""``weights="int4"`` on pc-rag's own kernels (:mod:`pc_rag.weights.blocks`): GGUF's Q4_1 and Q8_0
blocks found again bit for bit in a float32 model, products against torch's on the same weights,
one copy of the weights (4-bit) for decode and prefill, the kernels built once and rebuilt when
their cached copy is damaged, and torch's 4-bit kernel where they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pc_rag import PromptCache, PromptCacheError
from pc_rag.kernels import build, loader, products
from pc_rag.kernels.products import BLOCK
from pc_rag.weights import blocks
from pc_rag.weights.blocks import KERNEL_ROWS, BlockLinear
from pc_rag.weights.int4 import Int4Linear
from tests.test_llama_step import logprobs

from .conftest import assert_answers_as_float32, assert_same_logits_joined_and_apart, avx2_float_kernels, sixteen_bit_inputs_here


def test_the_kernels_build_and_load_here():
    """The machines pc-rag is tested on (x86-64, AVX2, a C compiler) run its kernels: no test here is
    skipped for want of them."""
    assert loader.cpu_supported() and build.compiler() is not None
    assert loader.library() is not None
    # and their AVX-512 forms where the CPU has them: agreeing with torch at load, so kept
    assert loader.library().wide_kernels(-1) == (torch.backends.cpu.get_cpu_capability() == "AVX512")
    assert loader.library().a16_kernels(-1) == ("avx512_vnni" in cpu_flags() and "avx512bw" in cpu_flags())


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (pc-rag's kernels are tested on x86-64 Linux)."""
    with open("/proc/cpuinfo") as info:
        return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())


def gguf_like(out_features: int, in_features: int, bits: int, seed: int = 0) -> torch.nn.Linear:
    """A linear layer whose weight is what a GGUF file's Q4_1 (``d*q + m``, fp16 ``d`` and ``m``, every
    block spanning q = 0..15) or Q8_0 (``d*q``, fp16 ``d``, |q| up to 127) blocks dequantize to."""
    generator = torch.Generator().manual_seed(seed)
    shape = (out_features, in_features // BLOCK, BLOCK)
    d = (torch.rand(*shape[:2], 1, generator=generator) * 0.02 + 1e-3).half().float()
    if bits == 4:
        q = torch.randint(0, 16, shape, generator=generator)
        q[..., 0], q[..., 1] = 0, 15
        m = ((torch.rand(*shape[:2], 1, generator=generator) - 0.5) * 0.2).half().float()
        weight = torch.addcmul(m, q.float(), d)
    else:
        q = torch.randint(-127, 128, shape, generator=generator)
        q[..., 0] = 127
        weight = q.float() * d
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        linear.weight.copy_(weight.reshape(out_features, in_features))
        linear.bias.normal_(generator=generator)
    return linear


@pytest.mark.parametrize("bits", [4, 8])
def test_gguf_blocks_are_found_again_bit_for_bit_and_multiplied_as_torch_does(bits, kernel_form):
    linear = gguf_like(97, 4 * BLOCK, bits)  # odd: the kernels' last output feature goes alone
    layer = BlockLinear(linear, bits)
    assert layer.exact == 1.0 and torch.equal(layer.dequantized(), linear.weight)
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 9, KERNEL_ROWS):  # the kernel: products exact, sums in its own order
        x = torch.randn(rows, 4 * BLOCK, generator=generator)
        expected = F.linear(x, linear.weight, linear.bias).detach()
        assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())), rows
    wide = torch.randn(2, KERNEL_ROWS + 3, 4 * BLOCK, generator=generator)  # dequantized, torch's GEMM: bit for bit
    assert torch.equal(layer(wide), wide @ linear.weight.detach().t() + linear.bias)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_avx2_float_kernels_give_a_row_the_same_bits_alone_as_beside_others(bits):
    """The float-input AVX2 forms (every CPU without AVX512-VNNI decodes on them) sum each row in one
    order whatever the rows beside it: one row, the passes of 8 rows and what is left agree bit for bit."""
    with avx2_float_kernels():
        linear = gguf_like(97, 6 * BLOCK, bits, seed=6)  # odd: the one-row kernel's last feature goes alone
        layer = BlockLinear(linear, bits)
        x = torch.randn(13, 6 * BLOCK, generator=torch.Generator().manual_seed(7))
        alone = torch.cat([layer(x[r:r + 1]) for r in range(13)])
        for rows in (2, 5, 8, 9, 13):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("bits", [4, 8])
def test_the_8_bit_input_kernels_multiply_the_inputs_as_they_round_them_exactly(bits):
    """weights="int4-a8": each block of 32 inputs rounded to 8 bits (llama.cpp's Q8_1 / Q8_0 inputs),
    then integer dot products: exact against torch on the rounded inputs, over rows that hold a large
    outlier, a block of zeros (scale 0) and a value at half a step; on AVX512-VNNI as on AVX2."""
    linear = gguf_like(97, 6 * BLOCK, bits, seed=2)
    layer = BlockLinear(linear, bits)
    generator = torch.Generator().manual_seed(3)
    weights = (layer.values, layer.scales, layer.minimums)  # minimums None: 8 bits
    for rows in (1, 2, 5):
        x = torch.randn(rows, 6 * BLOCK, generator=generator)
        x[0, 3], x[-1, BLOCK:2 * BLOCK] = 50.0, 0.0
        x[0, 4 * BLOCK:4 * BLOCK + 2] = torch.tensor([127.0, 0.5])  # 0.5 rounds to even: 0
        rounded = products.quantized_inputs(x)
        assert rounded[0, 4 * BLOCK + 1] == 0.0 and torch.equal(rounded[-1, BLOCK:2 * BLOCK], x[-1, BLOCK:2 * BLOCK])
        assert (rounded - x).abs().max() <= x.abs().max() / 254 * 1.0001  # half a step of the largest block's scale
        expected = rounded.double() @ linear.weight.double().t() + linear.bias.double()
        got = products.a8_matmul(x, *weights, linear.bias, lib=loader.library())
        assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-4), (got.double() - expected).abs().max()
        try:  # AVX512-VNNI where this CPU has it, else AVX2 again: every block summed exactly either way, the same bits
            assert loader.library().a8_vnni(0) == 0
            assert torch.equal(products.a8_matmul(x, *weights, linear.bias, lib=loader.library()), got)
        finally:
            loader.library().a8_vnni(1)
        assert not torch.allclose(got.double(), x.double() @ linear.weight.double().t() + linear.bias.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("blocks_per_row", [3, 6, 18])  # under one pass of 4 blocks, a pass and a half, the embedded model's 576
def test_the_16_bit_input_kernels_multiply_the_inputs_as_they_round_them_exactly(blocks_per_row):
    """weights="int4"'s C step on AVX512-VNNI: each block of 32 inputs rounded to 16 bits, then integer dot
    products: exact against torch on the rounded inputs, over rows that hold a large outlier, a block of
    zeros and a value at half a step; each row's outputs the same bits alone as beside 12 others; a NaN or
    an infinite input gives NaN outputs to its row only, as a float product does."""
    sixteen_bit_inputs_here()
    features = blocks_per_row * BLOCK
    linear = gguf_like(97, features, 4, seed=4)
    layer = BlockLinear(linear, 4)
    weights = (layer.values, layer.scales, layer.minimums)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(13, features, generator=generator)
    x[0, 3], x[-1, BLOCK:2 * BLOCK] = 3e4, 0.0
    x[0, 2 * BLOCK:2 * BLOCK + 2] = torch.tensor([32512.0, 0.5])  # 0.5 rounds to even: 0
    rounded = products.quantized_inputs(x, bits=16)
    assert rounded[0, 2 * BLOCK + 1] == 0.0 and torch.equal(rounded[-1, BLOCK:2 * BLOCK], x[-1, BLOCK:2 * BLOCK])
    assert (rounded - x).abs().max() <= x.abs().max() / 65024 * 1.0001  # half a step of the largest block's scale
    expected = rounded.double() @ linear.weight.double().t() + linear.bias.double()
    for rows in (1, 2, 5, 8, 9, 13):  # passes of 8 rows and what is left
        got = products.a16_matmul(x[:rows], *weights, linear.bias, lib=loader.library())
        assert torch.allclose(got.double(), expected[:rows], rtol=1e-5, atol=1e-4), (got.double() - expected[:rows]).abs().max()
        assert torch.equal(got, torch.cat([products.a16_matmul(x[r:r + 1], *weights, linear.bias, lib=loader.library()) for r in range(rows)]))
    broken = x[:3].clone()
    broken[0, 5], broken[2, -1] = float("nan"), float("inf")
    got = products.a16_matmul(broken, *weights, linear.bias, lib=loader.library())
    assert got[0].isnan().all() and got[2].isnan().all() and torch.equal(got[1], products.a16_matmul(x[1:2], *weights, linear.bias, lib=loader.library())[0])


def test_a_layer_refuses_what_its_kernels_cannot_read():
    """The kernels read raw float32 CPU memory: a model cast or moved after install is refused, not misread."""
    layer = BlockLinear(gguf_like(32, BLOCK, 4), 4)
    with pytest.raises(PromptCacheError, match="got torch.bfloat16 inputs"):
        layer(torch.randn(1, BLOCK, dtype=torch.bfloat16))
    layer.half()
    with pytest.raises(PromptCacheError, match="torch.float16 scales"):
        layer(torch.randn(1, BLOCK))


def test_a_wide_input_over_a_large_layer_is_multiplied_a_tile_at_a_time(monkeypatch):
    linear = gguf_like(100, 2 * BLOCK, 4)
    layer = BlockLinear(linear, 4)
    monkeypatch.setattr(blocks, "TILE_FLOATS", 30 * 2 * BLOCK)  # tiles of 30 output features: 4 of them
    x = torch.randn(KERNEL_ROWS + 1, 2 * BLOCK)
    assert torch.allclose(layer(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_a_float_checkpoint_is_quantized_within_half_a_step_of_each_block():
    torch.manual_seed(0)
    linear = torch.nn.Linear(4 * BLOCK, 64)
    for bits in (4, 8):
        layer = BlockLinear(linear, bits)
        assert layer.exact == 0.0
        error = (layer.dequantized() - linear.weight).abs().reshape(64, 4, BLOCK).amax(-1)
        assert (error <= layer.scales * 0.5001 + 1e-7).all()
    assert blocks.bits_for(linear, head=False) == 4 and blocks.bits_for(linear, head=True) == 8
    assert blocks.bits_for(gguf_like(64, 4 * BLOCK, 8), head=False) == 8  # a Q8_0 tensor stays in 8 bits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q, k and v, joined
def test_an_int4_engine_on_the_kernels_is_exact_on_every_path(make_tiny, tokenizer, arch):
    model = make_tiny(arch)
    engine = PromptCache(model, tokenizer, weights="int4")
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert engine.quantized_layers == len(layers) == 2 * 7 + 1 and not any(isinstance(m, Int4Linear) for m in model.modules())
    assert model.lm_head.bits == 8 and {layer.bits for layer in layers if layer is not model.lm_head} == {4}
    report = engine.check(fidelity=False)  # cached against full prefill, batches, joins: all on the same weights
    assert report.exact, str(report)


def test_int4_on_the_kernels_compiles_as_one_graph_and_decodes_as_eager(make_tiny, tokenizer):
    """The products are torch operators (pc_rag.kernels.ops): a compiled step is one graph, where every
    call into the kernels broke it before (and int4 refused compile=True)."""
    from torch._dynamo.utils import counters

    model = make_tiny("llama", seed=11)
    eager = PromptCache(model, tokenizer, recompute=0, weights="int4")
    eager.forward.written_step = None  # the tensor ops' step, as the compiled one computes it
    compiled = PromptCache(make_tiny("llama", seed=11), tokenizer, recompute=0, weights="int4", compile=True)
    counters.clear()
    prompt = "A prompt for the compiled step, long enough to decode a few tokens."
    for engine in (eager, compiled):
        engine.stop_token_ids = set()
    got, expected = (engine.generate(prompt, max_new_tokens=8, logprobs=2) for engine in (compiled, eager))
    assert compiled.forward.compiled_steps == 7 and got.token_ids == expected.token_ids
    assert dict(counters["graph_break"]) == {}
    assert torch.allclose(logprobs(got), logprobs(expected), atol=1e-4)


def test_layers_handed_the_same_input_share_one_product_bit_for_bit(make_tiny, tokenizer):
    apart, joined = make_tiny("qwen2"), make_tiny("qwen2")
    blocks.install(apart)
    for layer in apart.modules():
        if isinstance(layer, BlockLinear) and layer.siblings is not None:
            layer.siblings.undo()
    blocks.install(joined)
    attention, mlp = joined.model.layers[0].self_attn, joined.model.layers[0].mlp
    assert attention.q_proj.siblings is attention.k_proj.siblings is attention.v_proj.siblings is not None
    assert mlp.gate_proj.siblings is mlp.up_proj.siblings is not None and mlp.down_proj.siblings is None
    assert attention.k_proj.values.data_ptr() > attention.q_proj.values.data_ptr()  # views of the joined rows
    assert_same_logits_joined_and_apart(joined, apart, tokenizer)


def test_the_embedded_model_holds_its_gguf_values_exactly(model_dir):
    """Every projection of SmolLM2-135M's GGUF file is Q4_1 and its LM head Q8_0: each layer holds
    the float32 model's very weights, so prefill is bitwise float32's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    as_loaded = {name: module.weight.detach().clone() for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    ids = torch.arange(100, 100 + KERNEL_ROWS + 8)[None]  # wider than the kernels take
    with torch.inference_mode():
        before = model(ids).logits
        narrow = model(ids[:, :40]).logits
    assert blocks.install(model) == len(as_loaded) == 30 * 7 + 1
    layers = dict((name, module) for name, module in model.named_modules() if isinstance(module, BlockLinear))
    assert all(layer.exact == 1.0 for layer in layers.values())
    assert [name for name, layer in layers.items() if layer.bits == 8] == ["lm_head"]
    assert all(torch.equal(layer.dequantized(), as_loaded[name]) for name, layer in layers.items())
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)  # dequantized tiles, float32's GEMM
        # 40 rows: the kernels, the same products summed in their own order
        torch.testing.assert_close(model(ids[:, :40]).logits, narrow, rtol=0, atol=1e-3)


def test_a_damaged_kernel_library_is_built_again(tmp_path):
    """Each in a fresh process (a process keeps the library it loaded mapped: the loader hands the
    same one back by path): build; find the cached copy damaged; build it again."""
    env = {**os.environ, "PC_RAG_HOME": str(tmp_path), "PC_RAG_KERNELS": "build"}
    loads = [sys.executable, "-c", "from pc_rag.kernels import loader; assert loader.load() is not None"]
    subprocess.run(loads, env=env, check=True, timeout=300)
    (built,) = (tmp_path / "kernels").glob("block_kernels-*.so")
    damaged = tmp_path / "damaged"
    damaged.write_bytes(b"\x7fELF and then nothing")  # a half-written or corrupted file
    os.replace(damaged, built)
    finished = subprocess.run(loads, env=env, timeout=300, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert "rejected" in finished.stderr and "building them again" in finished.stderr
    assert built.stat().st_size > 1000 and built.read_bytes()[:4] == b"\x7fELF"
    assert sorted((tmp_path / "kernels").iterdir()) == [built.with_suffix(".lock"), built]  # no temporary left behind


@pytest.mark.parametrize("weights", ["int4", "int4-a8"])  # int4-a8's 8-bit inputs are the kernels': int4 on torch's, logged
def test_without_a_compiler_int4_runs_on_torchs_kernel(make_tiny, tokenizer, tmp_path, monkeypatch, caplog, weights):
    monkeypatch.setenv("PC_RAG_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PC_RAG_KERNELS", "build")  # no library from the install either
    loader.forget()
    try:
        assert loader.library() is None
        model = make_tiny("llama")
        PromptCache(model, tokenizer, weights=weights)
        assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
        assert (weights == "int4-a8") == any('weights="int4-a8" runs on pc-rag' in r.getMessage() for r in caplog.records)
    finally:
        loader.forget()


def test_the_embedded_model_answers_by_default_as_its_float32_checkpoint(smollm):
    """The default (the GGUF's own blocks on pc-rag's kernels) against the float32 checkpoint they
    dequantize to: the same greedy answer, and a first-token KL of float rounding (the kernels sum in
    their own order), cached and by full prefill."""
    assert smollm.weights == "int4" and isinstance(smollm.model.lm_head, BlockLinear)
    assert_answers_as_float32(smollm, 1e-5, 24)  # summation order only (3e-7 measured)
