"""A shared service, measured: registry sync, the cost of authentication, PML parsing.

1. Registry sync: a fresh replica takes in 1K, 10K and 30K document records that another
   process published (HotpotQA paragraphs, each made unique), in pages; then the periodic check
   with nothing new (what every request pays once per ``remote_sync_interval_s``).
2. Authentication: a module read from Redis with and without ``remote_key`` (the HMAC-SHA256
   over record and payload), per module, and the TTFT of a prompt importing documents from Redis
   either way (memory emptied before every run; median of ``--repeats``).
3. PML parsing: ``parse_schema`` of generated schemas of ~200 KB and ~1 MB (many modules).

    python benchmarks/shared_service.py            # starts its own redis-server on a free port

Writes benchmarks/results/shared_service.json and .md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import torch
from scaling import hotpot_paragraphs  # benchmarks/ is on the path of a script run from it

from pc_rag import PromptCache, build_prompt, parse_schema

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"  # --data changes it
SQUAD = "squad_v1.1_dev_super_bowl_50.json"
KEY = "benchmark-key"


def redis_server(folder: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                "--dir", folder, "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0"


def paragraphs(count: int, data_dir: Path) -> list[str]:
    """``count`` distinct documents: every HotpotQA paragraph scaling.py reads, again and again, each numbered."""
    base = hotpot_paragraphs(1 << 30, data_dir)
    return [f"{base[i % len(base)]} (record {i})" for i in range(count)]


def registry_sync(url: str, sizes: list[int], repeats: int, data_dir: Path) -> list[dict]:
    rows = []
    texts = paragraphs(max(sizes), data_dir)
    for size in sizes:
        redis.Redis.from_url(url).flushdb()
        writer = PromptCache.from_pretrained(remote_store=url, remote_sync=False, remote_key=KEY)
        system = writer.registry._document_schema("docs", None).system
        records = [{"name": f"d{i}", "text": texts[i], "metadata": {"i": i}} for i in range(size)]
        for start in range(0, size, 5000):
            assert writer.remote.log.publish_documents("docs", system, records[start : start + 5000])
        full, check = [], []
        for _ in range(repeats):
            replica = PromptCache.from_pretrained(remote_store=url, remote_sync=False, remote_key=KEY)
            started = time.perf_counter()
            assert replica.sync_documents() == size
            full.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert replica.sync_documents() == 0
            check.append(time.perf_counter() - started)
        tokens = sum(len(m.token_ids) for m in replica.schemas["docs"].layout.modules.values())
        row = {"documents": size, "tokens": tokens, "sync_s": statistics.median(full), "check_ms": 1e3 * statistics.median(check)}
        print(row, flush=True)
        rows.append(row)
    return rows


def authentication(url: str, repeats: int, data_dir: Path) -> dict:
    data = json.loads((data_dir / SQUAD).read_text())["data"]
    texts = [p["context"] for a in data for p in a["paragraphs"]][:8]
    out: dict = {}
    for label, key in (("unsigned", None), ("hmac", KEY)):
        redis.Redis.from_url(url).flushdb()
        writer = PromptCache.from_pretrained(remote_store=url, remote_key=key)
        names = writer.add_documents(texts, progress=False)
        reader = PromptCache.from_pretrained(remote_store=url, remote_key=key)
        keys = [reader.schemas["docs"].keys[n] for n in names]
        loads = []
        for _ in range(repeats):
            for entry in keys:
                started = time.perf_counter()
                assert reader.remote.load(entry) is not None
                loads.append(time.perf_counter() - started)
        prompt = build_prompt("Which team won Super Bowl 50?", names[:4])
        ttfts = []
        for _ in range(repeats + 1):
            reader.store.clear_memory()
            ttfts.append(reader.generate(prompt, max_new_tokens=1).stats.ttft_s)
        bytes_ = statistics.mean(reader.store.get(k).nbytes for k in keys)
        out[label] = {"load_ms": 1e3 * statistics.median(loads), "ttft_ms": 1e3 * statistics.median(ttfts[1:]),
                      "module_mb": bytes_ / 1e6, "modules_in_prompt": 4}
        print(label, out[label], flush=True)
    return out


def pml_schema(target_bytes: int) -> str:
    module = "<module name=\"m{0}\">Section {0}: the contract term is renewed each year &amp; billed monthly.\n</module>\n"
    parts, size, i = ['<schema name="big">\n<system>You answer questions about contracts.</system>\n'], 0, 0
    while size < target_bytes:
        piece = module.format(i)
        parts.append(piece)
        size += len(piece)
        i += 1
    parts.append("</schema>\n")
    return "".join(parts)


def pml(repeats: int) -> list[dict]:
    rows = []
    for target in (200_000, 1_000_000):
        text = pml_schema(target)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            doc = parse_schema(text)
            times.append(time.perf_counter() - started)
        row = {"bytes": len(text), "modules": sum(1 for _ in doc.children), "parse_s": statistics.median(times)}
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 30000])
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the data sets (benchmarks/data/README.md)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as folder:
        process, url = redis_server(folder)
        try:
            report = {"pml": pml(args.repeats), "registry_sync": registry_sync(url, args.sizes, args.repeats, args.data),
                      "authentication": authentication(url, max(args.repeats, 5), args.data)}
        finally:
            process.kill()
    (ROOT / "benchmarks/results/shared_service.json").write_text(json.dumps(report, indent=1))
    lines = ["| documents | tokens | fresh replica's sync | periodic check, nothing new |", "|---:|---:|---:|---:|"]
    for r in report["registry_sync"]:
        lines.append(f"| {r['documents']:,} | {r['tokens']:,} | {r['sync_s']:.2f} s | {r['check_ms']:.1f} ms |")
    a = report["authentication"]
    extra = a["hmac"]["load_ms"] - a["unsigned"]["load_ms"]
    lines += ["", "| records | module read from Redis | TTFT, 4 modules from Redis |", "|---|---:|---:|",
              f"| unsigned | {a['unsigned']['load_ms']:.1f} ms | {a['unsigned']['ttft_ms']:.0f} ms |",
              f"| HMAC-SHA256 | {a['hmac']['load_ms']:.1f} ms | {a['hmac']['ttft_ms']:.0f} ms |", "",
              f"Authentication adds {extra:.1f} ms per module of {a['hmac']['module_mb']:.1f} MB "
              f"({100 * 4 * extra / a['hmac']['ttft_ms']:.1f}% of the TTFT of a prompt importing 4 from Redis).", "",
              "| PML schema | modules | parse_schema |", "|---:|---:|---:|"]
    for r in report["pml"]:
        lines.append(f"| {r['bytes'] / 1e3:.0f} KB | {r['modules']:,} | {r['parse_s'] * 1e3:.0f} ms |")
    (ROOT / "benchmarks/results/shared_service.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
