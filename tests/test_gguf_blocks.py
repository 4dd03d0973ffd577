"""A GGUF file is served from its own blocks (:mod:`pc_rag.weights.gguf_blocks`): Q4_0, Q4_1 and Q4_K
at 4 bits, Q8_0 and Q5_0 at 8, each layer holding the very floats transformers read from the file;
other types (Q6_K) in 8-bit blocks from their floats, named in a log line. On tiny random GGUF files of
six families written as llama.cpp lays them out (Phi-3: q, k and v in one tensor, gate and up in another) (Llama's query and key rows permuted in the file)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from pc_rag import PromptCache
from pc_rag.weights import gguf_blocks
from pc_rag.weights.blocks import BlockLinear
from tests.gguf_files import Q, random_blocks, write_tiny_gguf

# a Q4_K_M file's mix (Q4_K, Q5_0, Q6_K, Q8_0) and the older 4-bit types, one per linear layer
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_0, "attn_v": Q.Q5_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q8_0,
         "ffn_down": Q.Q6_K}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Phi-3's joined tensors, the same mix (two Q4_K, a Q5_0, a Q6_K a layer)
JOINED_TYPES = {"attn_qkv": Q.Q4_K, "attn_output": Q.Q5_0, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
JOINED_HF_NAMES = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
                   "ffn_down": "mlp.down_proj"}


def types_of(arch: str) -> dict[str, Q]:
    return JOINED_TYPES if arch == "phi3" else TYPES


@pytest.mark.parametrize("kind", sorted(gguf_blocks.HELD))
def test_unpacked_blocks_hold_what_gguf_dequantizes_bit_for_bit(kind):
    rows, columns = 6, 512
    raw = random_blocks(Q[kind], rows, columns, np.random.default_rng(1))
    q, scales, minimums = gguf_blocks.unpack(kind, raw, rows, columns)
    expected = torch.from_numpy(dequantize(raw, Q[kind]).reshape(rows, columns))
    assert torch.equal(gguf_blocks._values(q, scales, minimums), expected)
    layer = BlockLinear(torch.nn.Linear(columns, rows, bias=False), gguf_blocks.HELD[kind], gguf_blocks._held(q, scales, minimums))
    assert torch.equal(layer.dequantized(), expected)  # the kernels' own dequantization: the same floats


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def served(request, tmp_path_factory):
    """A tiny GGUF of one family: the engine from_pretrained builds on it by default, and its float32 model."""
    arch = request.param
    path = write_tiny_gguf(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch, types_of(arch), seed=3,
                           untied=Q.Q6_K if arch == "qwen2" else None)
    from transformers import AutoModelForCausalLM

    as_read = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)  # no tokenizer: faster
    return arch, path, PromptCache.from_pretrained(path), as_read


def test_a_gguf_file_is_served_from_its_own_blocks_by_default(served):
    arch, _, engine, as_read = served
    assert as_read.config.model_type.startswith(arch)  # the family's own classes
    assert engine.weights == "int4"
    floats = dict(as_read.named_modules())
    layers = {name: module for name, module in engine.model.named_modules() if isinstance(module, BlockLinear)}
    hf_names = JOINED_HF_NAMES if arch == "phi3" else HF_NAMES
    for layer in range(2):
        for file_name, kind in types_of(arch).items():
            name = f"model.layers.{layer}.{hf_names[file_name]}"
            held, weight = layers[name], floats[name].weight.detach()
            if kind.name in gguf_blocks.HELD:  # the file's blocks: the floats transformers read, value for value
                assert held.bits == gguf_blocks.HELD[kind.name] and torch.equal(held.dequantized(), weight), name
            else:  # Q6_K: 8-bit blocks from the floats, finer than the file's 6 bits
                assert held.bits == 8 and not torch.equal(held.dequantized(), weight)
                assert (held.dequantized() - weight).abs().max() <= 0.01 * weight.abs().max(), name
    head = layers["lm_head"]
    assert head.bits == 8 and torch.equal(head.dequantized(), as_read.lm_head.weight.detach()) == (arch != "qwen2")


def test_a_type_not_held_is_named_in_one_log_line(served, caplog):
    _, path, _, as_read = served
    with caplog.at_level(logging.INFO, logger="pc_rag.weights.gguf_blocks"):
        gguf_blocks.file_blocks(path, as_read)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Q6_K: " in warnings[0] and "8-bit blocks" in warnings[0] and "largest error" in warnings[0]
    assert any("Q4_K 4" in r.getMessage() and "Q5_0 2" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_every_path_is_exact_and_the_c_step_decodes_the_files_blocks(served):
    arch, _, engine, _ = served
    report = engine.check(fidelity=False)
    assert report.exact, str(report)
    step = engine.forward.written_step
    assert step is not None and step.fused is not None, f"a {arch} file's blocks decode in C"
    before = step.fused.steps
    engine.generate("Name a primary colour.", max_new_tokens=4)
    assert step.fused.steps > before, "the file's blocks decode in C"


def test_a_file_that_does_not_match_the_model_gives_no_blocks(served, tmp_path, caplog):
    """Blocks from another file (same shapes, other values) are never used: each layer is checked value for value."""
    arch, _, engine, as_read = served
    other = write_tiny_gguf(tmp_path / "other.gguf", arch, types_of(arch), seed=4)
    with caplog.at_level(logging.WARNING, logger="pc_rag.weights.gguf_blocks"):
        given = gguf_blocks.file_blocks(other, as_read)
    assert all(bits == 8 for bits, _ in given.values())  # every layer quantized from the model's own floats
    assert "not the model's values" in caplog.text
