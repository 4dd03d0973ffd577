"""KV quantization at rest and load-or-compute, measured: bytes, fidelity and TTFT by tier.

1. ``quality``: for every record of a set, the same prompt (``build_prompt(question, passages)``)
   through three engines over one model object: ``kv_quantization`` None, ``"int8"``, ``"int4"``
   (each encodes its own modules), and full prefill. Per scheme: first-token KL to full prefill,
   the KL *added* over the unquantized cached path (same recovery, same tokens), the KL between
   the quantized and the unquantized cached distributions, first-token agreement on decisive
   questions, whole 16-token answers equal to the unquantized cached path's and to full prefill's.
2. ``ttft``: a prompt of ~4K tokens of SQuAD paragraphs; TTFT with module KV from memory, local
   disk, Redis, and Redis behind a proxy that forwards at ~2 MB/s (where the engine should
   choose to compute), per scheme, against full prefill; the median of ``--repeats``, the memory
   tier emptied before every disk/Redis run. Bytes per token as stored.

    python benchmarks/quantization.py quality --sets hotpotqa_more:40 nq:20 musique:10
    python benchmarks/quantization.py ttft --repeats 3          # starts its own redis-server

Writes benchmarks/results/quantization_<part>.json (and prints a markdown table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from quality import INSTRUCTION, load, margin  # noqa: E402
from scaling import ttft  # noqa: E402 - the same TTFT timing as the tier table in docs/scaling.md

import pc_rag.kv.load_or_compute  # noqa: E402
from pc_rag import PromptCache, build_prompt  # noqa: E402

DATA = ROOT / "benchmarks" / "data"  # --data changes it
SCHEMES = (None, "int8", "int4")
MAX_NEW = 16


def label(scheme: str | None) -> str:
    return scheme or "none"


def first_and_answer(engine: PromptCache, prompt: Any, use_cache: bool = True) -> tuple[torch.Tensor, list[int], float]:
    result = engine.generate(prompt, max_new_tokens=MAX_NEW, use_cache=use_cache, stop=["\n"], output_logits=True)
    return result.logits[0].log_softmax(-1), result.token_ids, result.stats.ttft_s


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) of two log-distributions, in nats."""
    return float((p.exp() * (p - q)).sum())


def quality(sets: list[str], data_dir: Path) -> dict[str, Any]:
    base = PromptCache.from_pretrained()
    engines = {s: base if s is None else PromptCache(base.model, base.tokenizer, kv_quantization=s) for s in SCHEMES}
    report: dict[str, Any] = {}
    for spec in sets:
        name, _, count = spec.partition(":")
        records = load(name, data_dir, int(count) if count else None, 0)
        rows: list[dict[str, Any]] = []
        for record in tqdm(records, desc=name, unit="question"):
            row: dict[str, Any] = {}
            outputs = {}
            for scheme, engine in engines.items():
                names = engine.add_documents(record.passages, progress=False)
                prompt = build_prompt(record.question + INSTRUCTION, names)
                if scheme is None:
                    full = first_and_answer(engine, prompt, use_cache=False)
                outputs[scheme] = first_and_answer(engine, prompt)
                row[f"bytes_per_token_{label(scheme)}"] = engine.store_stats()["bytes_per_token"]
                engine.store.delete(list(engine.store._memory))  # bound memory: this record's modules are not read again
            f, f_tokens, _ = full
            row["decisive"] = margin(f) >= 0.1
            u, u_tokens, _ = outputs[None]
            for scheme, (q, q_tokens, _) in outputs.items():
                key = label(scheme)
                row[f"kl_full_{key}"] = kl(f, q)
                row[f"kl_vs_unquantized_{key}"] = kl(u, q)
                row[f"agree_{key}"] = q_tokens[:1] == f_tokens[:1]
                row[f"answer_full_{key}"] = q_tokens == f_tokens
                row[f"answer_unquantized_{key}"] = q_tokens == u_tokens
            rows.append(row)
        decisive = [r for r in rows if r["decisive"]]
        summary: dict[str, Any] = {"questions": len(rows), "decisive": len(decisive)}
        for scheme in SCHEMES:
            key = label(scheme)
            summary[key] = {
                "kl_to_full": statistics.mean(r[f"kl_full_{key}"] for r in rows),
                "kl_added": statistics.mean(r[f"kl_full_{key}"] - r["kl_full_none"] for r in rows),
                "kl_to_unquantized": statistics.mean(r[f"kl_vs_unquantized_{key}"] for r in rows),
                "decisive_agreement": 100 * sum(r[f"agree_{key}"] for r in decisive) / max(1, len(decisive)),
                "answers_equal_full": 100 * statistics.mean(r[f"answer_full_{key}"] for r in rows),
                "answers_equal_unquantized": 100 * statistics.mean(r[f"answer_unquantized_{key}"] for r in rows),
                "bytes_per_token": statistics.mean(r[f"bytes_per_token_{key}"] for r in rows),
            }
        report[spec] = summary
        print(name, json.dumps(summary, indent=1), flush=True)
    return report


def quality_table(report: dict[str, Any]) -> str:
    lines = ["| set (questions, decisive) | scheme | bytes/token | KL to full prefill | KL added | KL to unquantized | decisive agreement | answers = unquantized | answers = full |",
             "|---|---|---|---|---|---|---|---|---|"]
    for spec, s in report.items():
        for scheme in SCHEMES:
            r = s[label(scheme)]
            lines.append(f"| {spec} ({s['questions']}, {s['decisive']}) | {label(scheme)} | {r['bytes_per_token']:.0f} | {r['kl_to_full']:.4f} "
                         f"| {r['kl_added']:+.4f} | {r['kl_to_unquantized']:.4f} | {r['decisive_agreement']:.1f}% "
                         f"| {r['answers_equal_unquantized']:.1f}% | {r['answers_equal_full']:.1f}% |")
    return "\n".join(lines)


# --- TTFT by tier ------------------------------------------------------------------------------------
def tiers(repeats: int, target_tokens: int, data_dir: Path) -> dict[str, Any]:
    from tests.conftest import RedisServer, ThrottledProxy

    pc_rag.kv.load_or_compute.MIN_SAVING_S = 0.005  # as shipped
    paragraphs = [p["context"] for a in json.loads((data_dir / "squad_v1.1_dev_super_bowl_50.json").read_text())["data"]
                  for p in a["paragraphs"]]
    base = PromptCache.from_pretrained()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        server = RedisServer(Path(folder) / "redis")
        (Path(folder) / "redis").mkdir()
        server.start()
        proxy = ThrottledProxy(server.port, 2e6)
        try:
            for scheme in SCHEMES:
                kv_dir = Path(folder) / f"kv-{label(scheme)}"
                settings = dict(kv_quantization=scheme)
                memory = PromptCache(base.model, base.tokenizer, kv_dir=kv_dir, remote_store=server.url, **settings)
                names = memory.add_documents(paragraphs, progress=False)
                lengths = {n: len(memory.schemas["docs"].layout.modules[n].token_ids) for n in names}
                chosen, total = [], 0
                for n in names[1:]:  # names[0]: warms the tiers' rates up
                    if total >= target_tokens:
                        break
                    chosen.append(n)
                    total += lengths[n]
                prompt = build_prompt("Which team won Super Bowl 50?", chosen)
                warm = build_prompt("What is this about?", names[:1])
                disk = PromptCache(base.model, base.tokenizer, kv_dir=kv_dir, **settings)
                disk.add_documents(paragraphs, progress=False)
                remote = PromptCache(base.model, base.tokenizer, remote_store=server.url, **settings)
                slow = PromptCache(base.model, base.tokenizer, remote_store=proxy.url, remote_timeout_ms=5000, **settings)
                for engine in (disk, remote, slow):
                    engine.generate(warm, max_new_tokens=1)  # one load measures the tier
                row = {"scheme": label(scheme), "prompt_tokens": len(memory.plan(prompt).input_ids), "documents": len(chosen)}
                row["memory_ms"] = 1e3 * ttft(memory, prompt, clear=False, repeats=repeats)
                row["bytes_per_token"] = memory.store_stats()["bytes_per_token"]
                row["disk_ms"] = 1e3 * ttft(disk, prompt, clear=True, repeats=repeats)
                row["redis_ms"] = 1e3 * ttft(remote, prompt, clear=True, repeats=repeats)
                row["redis_recomputed"] = remote.store_stats()["recomputed_tokens"]
                row["slow_redis_ms"] = 1e3 * ttft(slow, prompt, clear=True, repeats=repeats)
                row["slow_redis_recomputed_per_request"] = slow.store_stats()["recomputed_tokens"] / (repeats + 1)
                row["slow_rates"] = slow.costs.snapshot()
                row["full_prefill_ms"] = 1e3 * ttft(memory, prompt, use_cache=False, clear=False, repeats=repeats)
                print(row, flush=True)
                rows.append(row)
        finally:
            proxy.close()
            server.stop()
    return {"rows": rows}


def ttft_table(report: dict[str, Any]) -> str:
    lines = ["| scheme | bytes/token | memory | local disk | Redis | Redis at ~2 MB/s (choice) | full prefill | Redis / memory | slow Redis / full prefill |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        choice = "computed" if r["slow_redis_recomputed_per_request"] > 0 else "loaded"
        lines.append(f"| {r['scheme']} | {r['bytes_per_token']} | {r['memory_ms']:.0f} ms | {r['disk_ms']:.0f} ms | {r['redis_ms']:.0f} ms "
                     f"| {r['slow_redis_ms']:.0f} ms ({choice}) | {r['full_prefill_ms']:.0f} ms | {r['redis_ms'] / r['memory_ms']:.2f}x "
                     f"| {r['slow_redis_ms'] / r['full_prefill_ms']:.2f}x |")
    prompt = report["rows"][0]
    return f"Prompt: {prompt['prompt_tokens']} tokens, {prompt['documents']} documents.\n\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("quality", "ttft"))
    parser.add_argument("--sets", nargs="+", default=["hotpotqa_more:40", "nq:20", "musique:10"], help="SET[:FIRST]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4000, help="ttft: document tokens in the prompt")
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the data sets (benchmarks/data/README.md)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.part == "quality":
        report, table = quality(args.sets, args.data), quality_table
    else:
        report, table = tiers(args.repeats, args.tokens, args.data), ttft_table
    (ROOT / f"benchmarks/results/quantization_{args.part}.json").write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()
