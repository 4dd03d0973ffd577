"""Scaling out, measured: TTFT by the tier module KV comes from, and corpus encoding on Ray.

1. TTFT of one prompt that imports documents worth ~2K and ~4K tokens, with module KV read from
   memory, from local disk (``kv_dir``), from Redis (``remote_store``), against full prefill of the
   same tokens; one engine per tier, the memory tier emptied before every disk/Redis run (median
   of ``--repeats``). Bytes per module and per token as stored.
2. Encoding throughput: the same documents encoded in this process (``add_documents``) and by
   ``pc_rag.distributed.encode_documents`` with 1 and 2 Ray workers (one CPU each), into Redis.

    redis-server --port 6399 --save "" &   # any Redis; the benchmark flushes the DB it is given
    python benchmarks/scaling.py --redis redis://127.0.0.1:6399/0

Writes benchmarks/results/scaling.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import redis
import torch

from pc_rag import PromptCache, build_prompt

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"  # --data changes it
SQUAD = "squad_v1.1_dev_super_bowl_50.json"
HOTPOT = "hotpotqa_dev_distractor_more.jsonl"
QUESTION = "Which team won Super Bowl 50?"


def squad_paragraphs(data_dir: Path = DATA) -> list[str]:
    data = json.loads((data_dir / SQUAD).read_text())["data"]
    return [p["context"] for a in data for p in a["paragraphs"]]


def hotpot_paragraphs(count: int, data_dir: Path = DATA) -> list[str]:
    out: list[str] = []
    for line in (data_dir / HOTPOT).read_text().splitlines():
        for passage in json.loads(line)["passages"]:
            text = f"{passage['title']}: {passage['text'].strip()}"
            if text not in out:
                out.append(text)
            if len(out) == count:
                return out
    return out


def ttft(engine: PromptCache, prompt, *, use_cache: bool = True, clear: bool, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up (and is dropped)
        if clear:
            engine.store.clear_memory()
        times.append(engine.generate(prompt, max_new_tokens=1, use_cache=use_cache).stats.ttft_s)
    return statistics.median(times[1:])


def tiers(url: str, repeats: int, data_dir: Path) -> dict:
    paragraphs = squad_paragraphs(data_dir)
    with tempfile.TemporaryDirectory() as kv_dir:
        writer = PromptCache.from_pretrained(kv_dir=kv_dir, remote_store=url)
        names = writer.add_documents(paragraphs, progress=False)
        tokens = {n: len(writer.schemas["docs"].layout.modules[n].token_ids) for n in names}
        memory = writer  # everything in memory
        disk = PromptCache.from_pretrained(kv_dir=kv_dir)  # local disk only
        disk.add_documents(paragraphs, progress=False)
        remote = PromptCache.from_pretrained(remote_store=url)  # Redis only (took the documents in at start)
        rows = []
        for target in (2000, 4000):
            chosen, total = [], 0
            for name in names:
                if total >= target:
                    break
                chosen.append(name)
                total += tokens[name]
            prompt = build_prompt(QUESTION, chosen)
            result = {
                "prompt_tokens": len(writer.plan(prompt).input_ids),
                "documents": len(chosen),
                "memory_ms": 1e3 * ttft(memory, prompt, clear=False, repeats=repeats),
                "disk_ms": 1e3 * ttft(disk, prompt, clear=True, repeats=repeats),
                "redis_ms": 1e3 * ttft(remote, prompt, clear=True, repeats=repeats),
                "full_prefill_ms": 1e3 * ttft(memory, prompt, use_cache=False, clear=False, repeats=max(1, repeats // 2)),
            }
            print(result, flush=True)
            rows.append(result)
        assert remote.store_stats()["encoded"] == 0 and disk.store_stats()["encoded"] == 0
    return {"rows": rows}


def encoding(url: str, documents: int, data_dir: Path) -> dict:
    import ray

    from pc_rag.distributed import encode_documents

    texts = hotpot_paragraphs(documents, data_dir)
    client = redis.Redis.from_url(url)
    out = {"documents": len(texts)}
    client.flushdb()
    started = time.perf_counter()
    engine = PromptCache.from_pretrained(remote_store=url)
    names = engine.add_documents(texts, progress=False)
    out["in_process_s"] = time.perf_counter() - started
    out["tokens"] = sum(len(engine.schemas["docs"].layout.modules[n].token_ids) for n in names)
    records = [json.loads(client.get(k).decode().partition(" ")[2]) for k in client.scan_iter(f"{engine.remote.link.prefix}*:kv:*")
               if len(k.rsplit(b":", 1)[1]) == 64]  # records, not their chunks
    documents_only = [r for r in records if r.get("module") in set(names)]
    out["bytes_per_module"] = sum(r["bytes"] for r in documents_only) / len(documents_only)
    out["bytes_per_token"] = sum(r["bytes"] for r in documents_only) / sum(r["tokens"] for r in documents_only)
    out["kv_dtype"] = str(engine.spec.dtype)
    del engine
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        for workers in (1, 2):
            client.flushdb()
            started = time.perf_counter()
            encode_documents(texts, remote_store=url, num_workers=workers, progress=False)
            out[f"ray_{workers}_s"] = time.perf_counter() - started
            print(out, flush=True)
    finally:
        ray.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", required=True, help="redis://HOST:PORT/DB (flushed)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--documents", type=int, default=120)
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the data sets (benchmarks/data/README.md)")
    parser.add_argument("--tiers-from", type=Path, default=None, help="take part 1 from this earlier scaling.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    redis.Redis.from_url(args.redis).flushdb()
    measured = json.loads(args.tiers_from.read_text())["tiers"] if args.tiers_from else tiers(args.redis, args.repeats, args.data)
    report = {"tiers": measured, "encoding": encoding(args.redis, args.documents, args.data)}
    out = ROOT / "benchmarks/results/scaling.json"
    out.write_text(json.dumps(report, indent=1))
    t, e = report["tiers"], report["encoding"]
    lines = ["| prompt tokens | documents | memory | local disk | Redis | full prefill | Redis vs full prefill |", "|---|---|---|---|---|---|---|"]
    for r in t["rows"]:
        lines.append(f"| {r['prompt_tokens']} | {r['documents']} | {r['memory_ms']:.0f} ms | {r['disk_ms']:.0f} ms | {r['redis_ms']:.0f} ms "
                     f"| {r['full_prefill_ms']:.0f} ms | {r['full_prefill_ms'] / r['redis_ms']:.1f}x |")
    lines.append("")
    lines.append(f"Stored entries: {e['bytes_per_module'] / 1e6:.2f} MB per module on average, "
                 f"{e['bytes_per_token'] / 1e3:.1f} KB per token ({e['kv_dtype']}).")
    lines.append("")
    lines.append(f"Encoding {e['documents']} documents ({e['tokens']} tokens) into Redis: in one process "
                 f"{e['in_process_s']:.1f} s; Ray, 1 worker {e['ray_1_s']:.1f} s; Ray, 2 workers {e['ray_2_s']:.1f} s.")
    (ROOT / "benchmarks/results/scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
