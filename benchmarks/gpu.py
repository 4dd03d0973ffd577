"""The GPU table in one command: TTFT, decode and shared-batch throughput against transformers.

On one model (``--model``, or by default a Llama-3-8B-shaped model with random bf16 weights,
since TTFT and throughput do not depend on weight values and the device machine reaches no hub),
in one run, median of ``--runs`` after a warm-up:

- TTFT at each of ``--lengths`` prompt tokens (SQuAD paragraphs, cycled, stored with
  ``add_documents``): full prefill (``use_cache=False``), cached with module KV in GPU memory
  (``kv_location="device"``) and in pinned host memory (``kv_location="cpu"``);
- decode ms/token at the first length: pc-rag (cached prompt) and transformers'
  ``model.generate`` on the same prompt text (both greedy, ``--new-tokens`` tokens);
- shared-batch throughput: ``--batch`` prompts importing the same documents with different
  questions, ``engine.generate_batch`` (shared-module attention) against ``model.generate`` on
  the same prompts left-padded into one batch (tokens generated per second, whole call), and
  ``generate_batch(share_modules=False)``: every row its own copy of the documents, the batches a
  compiled step serves (one whose rows read shared parts runs eagerly);
- the weight-read time: the model's weight bytes over the device's copy bandwidth (measured
  here), the floor of a batch-1 decode step, next to the measured ms/token;
- for each N in ``--callers``: N threads calling ``generate`` at once (the scheduler batches
  them; an eager engine, whose rows read the documents shared), ``generate_batch`` of the same N
  prompts and the N one after another; with ``--compile`` also N threads calling the compiled
  engine's ``generate`` (its rows copy the documents, every step compiled): tokens/s of each.

``--compile`` compiles the decode step (mode "default"); ``--compile reduce-overhead`` replays it
as a CUDA graph. Either way it is compiled for every padded batch size before anything is timed
(``engine.warm_up()``; its seconds are in the results as ``warm_up_s``).

    python benchmarks/gpu.py                                 # CUDA, synthetic 8B-shaped model
    python benchmarks/gpu.py --compile reduce-overhead --lengths 4096 --runs 2 --new-tokens 32 --callers 8 16 --kv-quantization
    python benchmarks/gpu.py --device cpu --model embedded --lengths 512 --batch 2 --new-tokens 4 --runs 1
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder
from ttft import median_time, timed  # the same timing as the TTFT curve

from pc_rag import PromptCache
from pc_rag.prompt.documents import build_prompt

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["Which team won the game?", "Where was the game played?", "Who performed at halftime?",
             "What was the final score?", "Who was the most valuable player?", "Which network broadcast it?",
             "When was the game played?", "How many people watched it?"]


def synthetic_8b(device: str, tokenizer: Any) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=500000.0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    from pc_rag.model.loading import default_model_dir, load_model

    if args.model == "synthetic-8b":
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_model_dir())
        return synthetic_8b(args.device, tokenizer), tokenizer
    return load_model(None if args.model == "embedded" else args.model, device=args.device, dtype=args.dtype)


def documents_of(length: int, paragraphs: list[str], tokenizer: Any) -> list[str]:
    """Paragraphs (cycled) whose tokens add up to about ``length``."""
    chosen, total, index = [], 0, 0
    while total < length:
        text = paragraphs[index % len(paragraphs)]
        chosen.append(text if index < len(paragraphs) else f"({index}) {text}")
        total += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2
        index += 1
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic-8b", help='"synthetic-8b", "embedded", or a hub id/folder')
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", nargs="?", const=True, default=False,
                        help='decode through torch.compile (compile=True), or in a mode by name ("reduce-overhead": CUDA graphs)')
    parser.add_argument("--callers", type=int, nargs="*", default=[], help="concurrent callers to measure (threads calling generate)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for synthetic-8b (default: the embedded model's)")
    parser.add_argument("--kv-quantization", nargs="*", default=["int8", "int4"], help="also cached TTFT with module KV stored so")
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu.json")
    args = parser.parse_args()

    model, tokenizer = load(args)
    article = json.loads((args.data / "squad_v1.1_dev_super_bowl_50.json").read_text())["data"][0]
    paragraphs = [p["context"] for p in article["paragraphs"]]
    on_device = PromptCache(model, tokenizer, kv_location="device", compile=args.compile)
    on_host = PromptCache(model, tokenizer, kv_location="cpu")
    quantized = {q: PromptCache(model, tokenizer, kv_location="device", kv_quantization=q) for q in args.kv_quantization}
    # with --compile: compiled for every padded batch size before anything is timed (a compilation
    # inside a timed run of two would be half the median)
    warm_up_s = on_device.warm_up().seconds
    print(json.dumps({"warm_up_s": warm_up_s}), flush=True)
    rows = []
    for length in args.lengths:
        docs = documents_of(length, paragraphs, tokenizer)
        ids = [f"len{length}-{i}" for i in range(len(docs))]
        for engine in (on_device, on_host, *quantized.values()):
            engine.add_documents(docs, ids=ids, progress=False)
        prompt = build_prompt(QUESTIONS[0], ids)
        tokens = on_device.generate(prompt, max_new_tokens=1).stats
        row = {"prompt_tokens": tokens.cached_tokens + tokens.computed_tokens, "ttft_ms": {
            "full prefill": 1000 * median_time(timed(lambda: on_device.generate(prompt, max_new_tokens=1, use_cache=False)), args.runs),  # noqa: B023
            "cached (GPU memory)": 1000 * median_time(timed(lambda: on_device.generate(prompt, max_new_tokens=1)), args.runs),  # noqa: B023
            "cached (host memory)": 1000 * median_time(timed(lambda: on_host.generate(prompt, max_new_tokens=1)), args.runs),  # noqa: B023
            **{f"cached (GPU memory, {q})": 1000 * median_time(timed(lambda e=e: e.generate(prompt, max_new_tokens=1)), args.runs)  # noqa: B023
               for q, e in quantized.items()},
        }, "prefill_tokens_per_s": on_device.costs.snapshot().get("prefill_tokens_per_s"),
           "kv_bytes_per_token": {"none": on_device.store_stats()["bytes_per_token"],
                                  **{q: e.store_stats()["bytes_per_token"] for q, e in quantized.items()}}}
        rows.append(row)
        print(json.dumps(row))

    # decode and shared batches, at the first length
    docs = documents_of(args.lengths[0], paragraphs, tokenizer)
    ids = [f"len{args.lengths[0]}-{i}" for i in range(len(docs))]
    on_device.stop_token_ids = set()  # every call generates exactly --new-tokens tokens
    prompts = [build_prompt(QUESTIONS[i % len(QUESTIONS)], ids) for i in range(args.batch)]
    n = args.new_tokens
    on_device.generate(prompts[0], max_new_tokens=n)  # warm-up (this prompt's buffer; under "reduce-overhead" its CUDA graph)
    decode_ms = median_decode_ms(on_device, prompts[0], n, args.runs)
    reference = transformers_generate(model, tokenizer, on_device, prompts, n, args.runs)
    batch_s = median_time(timed(lambda: on_device.generate_batch(prompts, max_new_tokens=n, share_modules=True)), args.runs)
    # each row its own copy of the documents (what a compiled engine does by default): with
    # --compile every step runs compiled (a CUDA graph under "reduce-overhead"); one that reads shared parts runs eagerly
    copied_s = median_time(timed(lambda: on_device.generate_batch(prompts, max_new_tokens=n, share_modules=False)), args.runs)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_read_ms = 1000 * weight_bytes / copy_bandwidth(model.device)
    result = {
        **run_info(on_device, args.model),
        "compile": args.compile, "warm_up_s": warm_up_s,
        "ttft": rows,
        "decode_ms_per_token": {"pc-rag": decode_ms, "transformers generate": reference["decode_ms"]},
        "weight_read_ms": weight_read_ms, "decode_vs_weight_read": decode_ms / weight_read_ms,
        "callers": concurrent_callers(model, tokenizer, docs, ids, args.callers, n, args.runs, on_device),
        # the (rows, capacity) shapes the compiled step ran at: one CUDA graph each under "reduce-overhead"
        "compiled_shapes": sorted(on_device.forward.compiled_shapes),
        "batch": args.batch, "new_tokens": n,
        "batch_tokens_per_s": {"pc-rag generate_batch (shared)": args.batch * n / batch_s,
                               "pc-rag generate_batch (modules copied per row)": args.batch * n / copied_s,
                               "transformers generate (padded batch)": reference["batch_tokens_per_s"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "ttft"}, indent=1))


def median_decode_ms(engine: PromptCache, prompt: str, n: int, runs: int) -> float:
    """ms per decoded token after the first (the call's time past its TTFT), median of ``runs`` calls."""
    per_token = []
    for _ in range(max(runs, 1)):
        stats = engine.generate(prompt, max_new_tokens=n).stats
        per_token.append(1000 * (stats.total_s - stats.ttft_s) / max(1, stats.generated_tokens - 1))
    return statistics.median(per_token)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second the device reads (a copy of a 1 GiB tensor reads and writes it once)."""
    source = torch.ones(1 << 28, dtype=torch.float32, device=device)  # written: untouched host pages read as free
    target = torch.empty_like(source)
    seconds = median_time(timed(lambda: target.copy_(source)), 5)
    return 2 * source.numel() * source.element_size() / seconds


def concurrent_callers(model: Any, tokenizer: Any, docs: list[str], ids: list[str], callers: list[int], n: int, runs: int,
                       measured: PromptCache) -> list[dict[str, Any]]:
    """Tokens/s of N threads calling ``generate`` at once, of ``generate_batch`` and of the N one
    after another, each prompt the same documents with its own question (median of ``runs``), on
    an eager engine whose rows read the documents shared; and, when ``measured`` compiles its
    decode steps, of N threads calling its ``generate`` (rows copy the documents, every step compiled)."""
    from concurrent.futures import ThreadPoolExecutor

    engine = PromptCache(model, tokenizer, kv_location="device")
    engine.stop_token_ids = set()
    engine.add_documents(docs, ids=ids, progress=False)
    out = []
    for count in callers:
        prompts = [build_prompt(f"{QUESTIONS[i % len(QUESTIONS)]} ({i})", ids) for i in range(count)]

        def threads(engine: PromptCache = engine) -> None:
            with ThreadPoolExecutor(count) as workers:
                list(workers.map(lambda p: engine.generate(p, max_new_tokens=n), prompts))  # noqa: B023

        def sequential() -> None:
            for prompt in prompts:
                engine.generate(prompt, max_new_tokens=n)

        row = {"callers": count, "tokens_per_s": {
            "threads calling generate": count * n / median_time(timed(threads), runs),
            "generate_batch": count * n / median_time(timed(lambda: engine.generate_batch(prompts, max_new_tokens=n)), runs),  # noqa: B023
            "one after another": count * n / median_time(timed(sequential), runs)}}
        if measured.forward.compiled:
            row["tokens_per_s"]["threads calling generate, compiled engine"] = count * n / median_time(
                timed(lambda: threads(measured)), runs)  # noqa: B023
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def transformers_generate(model: Any, tokenizer: Any, engine: PromptCache, prompts: list[str], n: int, runs: int) -> dict[str, float]:
    """transformers' own generate on the same prompt tokens: decode ms/token (one prompt) and batch tokens/s."""
    rows = [engine.plan(p).input_ids for p in prompts]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)

    def generate(batch: int, new: int) -> Any:
        return model.generate(input_ids=ids[:batch], attention_mask=mask[:batch], max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=pad)

    with torch.inference_mode():
        # the decode time is a difference of two calls' times: one sample of each (--runs 1) was noise enough to make it negative
        first = median_time(timed(lambda: generate(1, 1)), max(runs, 3))
        whole = median_time(timed(lambda: generate(1, n)), max(runs, 3))
        batch = median_time(timed(lambda: generate(len(prompts), n)), runs)
    return {"decode_ms": 1000 * (whole - first) / max(1, n - 1), "batch_tokens_per_s": len(prompts) * n / batch}


if __name__ == "__main__":
    main()
