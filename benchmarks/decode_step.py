"""One decode step of the embedded model, part by part, on the calling thread (``--threads``: one,
or two as the engine's decode steps measure best on the 2-core CPU): the written-out step (``pc_rag.forward.llama_step``: in one C
call where the weights are pc-rag's blocks, ``pc_rag.forward.fused_step``), the same step as tensor
ops, the model's own forward, and the parts every step must run: the linear layers alone (every projection
and the LM head on one row) and attention alone (SDPA over each layer's KV). What the steps take
beyond linears + attention (the tensor ops') is their glue: norms, RoPE, residuals, the KV write, and Python.

Against the bytes a step must read: every linear layer's weights as held (4-bit words, scales and
minimums; the LM head's 8-bit values) and the cache's keys and values, at the stream bandwidth
measured in every round on the same threads (``torch.sum`` over 512 MB, best of 3): the "read time"
and the written step's multiple of it (the median of the rounds' ratios: this machine's bandwidth
drifts by a third within minutes).

The cache is a ``--cache``-entry buffer of random KV (decode time does not depend on the values),
fixed for decoding as the engine fixes it; the mask is additive, as for a RAG prompt. The variants
are interleaved ``--rounds`` times, ``--steps`` steps each (after 3 unmeasured: torch's OpenMP threads
spin for a few ms after a variant's parallel ops, on the cores the C step's own threads need), so the
machine's drift hits them alike; medians in ms.

    python benchmarks/decode_step.py                     # int4 (the default) and float16 weights, ~2 min
    python benchmarks/decode_step.py --weights int4 int4-a8 --threads 2
    python benchmarks/decode_step.py --weights int4 --compiled    # also the model's own step through torch.compile
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder

from pc_rag import PromptCache
from pc_rag.kv.buffers import KVBuffer

ROOT = Path(__file__).resolve().parents[1]


def timed(run: Callable[[], object], steps: int, warm: int = 3) -> float:
    """Median ms of ``steps`` calls, after ``warm`` unmeasured ones: torch's OpenMP threads spin for a
    few ms after the previous variant's last parallel op, on the cores the C step's threads need."""
    for _ in range(warm):
        run()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def stream_gb_s(data: torch.Tensor) -> float:
    """GB/s ``torch.sum`` reads ``data`` at on the current threads (best of 3)."""
    return data.numel() * data.element_size() / min(timed(data.sum, 1, warm=0) for _ in range(3)) / 1e6


def read_bytes(step, buffer: KVBuffer, cache: int) -> int:
    """What one step must read: the linear layers' weights as held, and ``cache`` entries of keys and values."""
    linears = [getattr(layer, name) for layer in step.layers for name in ("q", "k", "v", "o", "gate", "up", "down")] + [step.head]
    weights = sum(t.numel() * t.element_size() for linear in linears for t in (*linear.parameters(), *linear.buffers())
                  if t.numel() > 32)  # not float16's digest: its weights are packed, 2 bytes each
    weights += sum(2 * linear.in_features * linear.out_features for linear in linears if hasattr(linear, "packed"))
    per_entry = buffer.storage[:, :, :1, ..., :1, :].numel() * buffer.storage.element_size()  # keys and values, every layer
    return weights + cache * per_entry


@torch.inference_mode()
def measure(weights: str, cache: int, rounds: int, steps: int, threads: int, compiled: bool = False) -> dict[str, float]:
    engine = PromptCache.from_pretrained(weights=weights)
    step = engine.forward.written_step
    assert step is not None, "the embedded model decodes written out"
    buffer = KVBuffer.for_model(engine.model, cache + 32)
    buffer.storage.normal_()
    buffer.grow_to(cache)
    buffer.fix(cache + 32, torch.tensor([cache]))
    mask = torch.zeros(1, 1, 1, cache + 32)
    mask[..., cache + 1:] = torch.finfo(torch.float32).min
    ids, positions = torch.tensor([[42]]), torch.tensor([[cache]])
    hidden, wide = torch.randn(1, 1, step.layers[0].q.in_features), torch.randn(1, 1, step.layers[0].down.in_features)
    query = torch.randn(1, step.kv_heads, step.heads // step.kv_heads, hidden.shape[-1] // step.heads)

    def linears() -> None:
        for layer in step.layers:
            for linear in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up):
                linear(hidden)
            layer.down(wide)
        step.head(hidden)

    def attention() -> None:
        for index, layer in enumerate(step.layers):
            kv = buffer.cache.layers[index]
            F.scaled_dot_product_attention(query, kv.keys, kv.values, attn_mask=mask, scale=layer.scaling)

    fused = step.fused  # the whole step in one C call (blocks on pc-rag's kernels), else None

    def tensor_ops() -> torch.Tensor:
        step.fused = None
        try:
            return step(ids, positions, mask, buffer.cache)
        finally:
            step.fused = fused

    variants = {"written step": lambda: step(ids, positions, mask, buffer.cache),
                "written step, tensor ops": tensor_ops,
                "model's own step": lambda: engine.forward._model_step(ids, positions, mask, buffer.cache),
                "linear layers": linears, "attention": attention}
    if compiled:  # the model's own step through torch.compile, its products as torch operators (pc_rag.kernels.ops)
        compiled_step = torch.compile(engine.forward._model_step, dynamic=None)
        variants["model's own step, compiled"] = lambda: compiled_step(ids, positions, mask, buffer.cache)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for run in variants.values():  # first calls: allocations, kernel choices
            run()
        times: dict[str, list[float]] = {name: [] for name in variants}
        streams, data = [], torch.ones(128 * 2**20)
        for _ in range(rounds):
            for name, run in variants.items():
                times[name].append(timed(run, steps))
            streams.append(stream_gb_s(data))
    finally:
        torch.set_num_threads(previous)
    out = {name: statistics.median(values) for name, values in times.items()}
    out["in C"] = fused is not None
    out["8-bit inputs"] = fused is not None and fused.activation_bits == 8
    out["input bits"] = fused.activation_bits if fused is not None else 32  # 16: int4 on AVX512-VNNI (a16_kernels.c)
    out["read MB"] = read_bytes(step, buffer, cache) / 1e6
    out["stream GB/s"] = statistics.median(streams)
    out["read time"] = out["read MB"] / out["stream GB/s"]
    out["written step / read time"] = statistics.median(t * g / out["read MB"] for t, g in zip(times["written step"], streams))
    out["glue, written"] = out["written step, tensor ops"] - out["linear layers"] - out["attention"]
    out["glue, model's own"] = out["model's own step"] - out["linear layers"] - out["attention"]
    out["run"] = run_info(engine, "SmolLM2-135M-Instruct (embedded)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", nargs="+", default=["int4", "float16"])
    parser.add_argument("--cache", type=int, default=1265, help="KV entries attended (a ~1.2K-token RAG prompt)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true", help="also the model's own step through torch.compile")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_step.json")
    args = parser.parse_args()
    result = {"cache": args.cache, "rounds": args.rounds, "steps": args.steps, "threads": args.threads, "weights": {}}
    for weights in args.weights:
        result["weights"][weights] = measure(weights, args.cache, args.rounds, args.steps, args.threads, args.compiled)
        print(weights, json.dumps({k: round(v, 2) for k, v in result["weights"][weights].items() if k != "run"}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
