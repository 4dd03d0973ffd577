"""Batched serving: decode throughput and TTFT of requests that share their modules.

Every request of a batch imports the same system prompt and the same documents (the first
paragraphs of the SQuAD v1.1 article "Super_Bowl_50", up to ``--shared`` tokens) and asks its
own question (that article's questions). For batches of ``--batches`` requests, in one run on
the same model, median of ``--runs`` runs after a warm-up:

- ``sequential``: ``engine.generate`` on each prompt in turn
- ``naive batch``: ``engine.generate_batch(..., share_modules=False)``: each request prefilled
  on its own, then decoded together with its own copy of the shared KV
- ``shared batch``: ``engine.generate_batch(...)``: shared-module attention (the shared KV held
  once and read once per step for the whole batch; computed tokens prefilled in one pass)

Every request generates exactly ``--new-tokens`` tokens (end-of-sequence tokens are ignored,
so every mode does the same work). Reported: decode throughput (tokens generated after the
first, per second of decoding), overall throughput, and mean TTFT counted from the moment the
whole batch was submitted (a sequential request waits for the ones before it). Also single-
request cached TTFT with ``assembly="copy"`` (module KV copied into the request's cache) and
``assembly="in_place"`` (zero-copy: attended to where it is stored).

    python benchmarks/throughput.py                       # embedded SmolLM2-135M on CPU
    python benchmarks/throughput.py --device cuda --batches 1 4 8 16 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder

from pc_rag import PromptCache, build_prompt

ROOT = Path(__file__).resolve().parents[1]


def squad(data: Path) -> tuple[list[str], list[str]]:
    article = json.loads((data / "squad_v1.1_dev_super_bowl_50.json").read_text())["data"][0]
    contexts = [p["context"] for p in article["paragraphs"]]
    questions = list(dict.fromkeys(q["question"] for p in article["paragraphs"] for q in p["qas"]))
    return contexts, questions


def documents_up_to(engine: PromptCache, contexts: list[str], tokens: int) -> list[str]:
    chosen, total = [], 0
    for text in contexts:
        size = len(engine.tokenize(text))
        if total + size > tokens:
            break
        chosen.append(text)
        total += size
    return chosen


def measure(engine: PromptCache, prompts: list[str], mode: str, new_tokens: int) -> dict[str, float]:
    """One run of one mode: decode and overall throughput, mean TTFT from submission."""
    start = time.perf_counter()
    if mode == "sequential":
        ttfts, generated, decode_s = [], 0, 0.0
        for prompt in prompts:
            offset = time.perf_counter() - start
            result = engine.generate(prompt, max_new_tokens=new_tokens)
            ttfts.append(offset + result.stats.ttft_s)
            generated += result.stats.generated_tokens
            decode_s += result.stats.total_s - result.stats.ttft_s
        wall = time.perf_counter() - start
        decoded = generated - len(prompts)
    else:
        results = engine.generate_batch(prompts, max_new_tokens=new_tokens, share_modules=mode == "shared batch")
        wall = time.perf_counter() - start
        ttfts = [r.stats.ttft_s for r in results]
        generated = sum(r.stats.generated_tokens for r in results)
        decoded = generated - len(prompts)
        decode_s = wall - max(ttfts)  # the batch decodes after its last first token
    if generated != new_tokens * len(prompts):
        raise RuntimeError(f"{mode}: {generated} tokens generated, expected {new_tokens * len(prompts)}")
    return {
        "decode_tokens_per_s": decoded / decode_s,
        "tokens_per_s": generated / wall,
        "mean_ttft_ms": 1000 * statistics.mean(ttfts),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--shared", type=int, nargs="+", default=[2048, 4096], help="shared document tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["sequential", "naive batch", "shared batch"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--weights", default=None, help="weights= of the engines (default: the model as loaded, float32)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "throughput.json")
    args = parser.parse_args()

    from pc_rag.model.loading import load_model

    model, tokenizer = load_model(args.model, device=args.device)
    # the first engine sets the weights' precision in the model; the second serves the model as it then is
    engines = {"copy": PromptCache(model, tokenizer, assembly="copy", weights=args.weights)}
    engines["in_place"] = PromptCache(model, tokenizer, assembly="in_place")
    engine = engines["copy"]
    for each in engines.values():
        each.stop_token_ids = set()  # fixed-length generations: every mode does the same work
    contexts, questions = squad(args.data)

    rows: list[dict[str, Any]] = []
    for shared in args.shared:
        texts = documents_up_to(engine, contexts, shared)
        for each in engines.values():
            names = each.add_documents(texts, progress=False)
        prompts = [build_prompt(q, names) for q in questions]
        plan = engine.plan(prompts[0])
        single = {}
        for assembly, each in engines.items():
            each.generate(prompts[0], max_new_tokens=1)
            single[assembly] = 1000 * statistics.median(
                [each.generate(prompts[i % len(prompts)], max_new_tokens=1).stats.ttft_s for i in range(max(5, args.runs))]
            )
        print(f"{plan.cached_tokens} shared tokens: single-request TTFT copy {single['copy']:.0f} ms, in place {single['in_place']:.0f} ms", flush=True)
        for size in args.batches:
            batch = prompts[:size]
            row: dict[str, Any] = {"shared_tokens": plan.cached_tokens, "batch": size, "documents": len(texts), "modes": {}}
            for mode in args.modes:
                measure(engine, batch, mode, 2)  # warm-up (buffer pool, allocator)
                runs = [measure(engine, batch, mode, args.new_tokens) for _ in range(args.runs)]
                row["modes"][mode] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            if "naive batch" in row["modes"] and "shared batch" in row["modes"]:
                naive, shared_mode = row["modes"]["naive batch"], row["modes"]["shared batch"]
                row["shared_vs_naive_decode"] = shared_mode["decode_tokens_per_s"] / naive["decode_tokens_per_s"]
            row["single_request_ttft_ms"] = single
            rows.append(row)
            print(
                f"  batch {size:2d}: "
                + " | ".join(f"{m} {v['decode_tokens_per_s']:.1f} tok/s, TTFT {v['mean_ttft_ms']:.0f} ms" for m, v in row["modes"].items()),
                flush=True,
            )

    result = {
        **run_info(engine, args.model or "SmolLM2-135M-Instruct (embedded)"),
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    lines = [
        f"# Batched decoding: {result['model']} on {result['device']} ({result['dtype']}), {args.new_tokens} tokens per request, median of {args.runs}",
        "",
        "| shared tokens | batch | " + " | ".join(f"{m} tok/s | {m} mean TTFT ms" for m in args.modes) + " | shared / naive decode |",
        "|---|---|" + "---|---|" * len(args.modes) + "---|",
    ]
    for row in rows:
        cells = [f"{row['modes'][m]['decode_tokens_per_s']:.1f} | {row['modes'][m]['mean_ttft_ms']:.0f}" for m in args.modes]
        ratio = f"{row['shared_vs_naive_decode']:.2f}x" if "shared_vs_naive_decode" in row else "-"
        lines.append(f"| {row['shared_tokens']} | {row['batch']} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "| shared tokens | single-request cached TTFT, copy (ms) | in place (ms) |", "|---|---|---|"]
    for row in rows:
        if row["batch"] == args.batches[0]:
            single = row["single_request_ttft_ms"]
            lines.append(f"| {row['shared_tokens']} | {single['copy']:.0f} | {single['in_place']:.0f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
