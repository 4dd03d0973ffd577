"""``pc-rag serve`` measured: what the HTTP layer costs over the in-process engine.

Part ``http`` (the embedded SmolLM2-135M): HotpotQA dev-distractor records (``--skip`` records in,
never used for tuning), each a chat request whose user message pastes ``--passages`` passages and
asks the question; the passages are registered as documents first (over HTTP for the server,
``add_documents`` in-process), so both read them from the cache (drop-in). For each N in
``--clients``, N requests at once, ``--new-tokens`` tokens each (stop tokens off):

- ``server``: N streaming ``POST /v1/chat/completions`` from an ``httpx.AsyncClient`` to a
  ``pc-rag serve`` process on this machine; TTFT is the arrival of the first content event;
- ``in-process``: N ``engine.astream`` calls of the same rendered prompts under ``asyncio.gather``
  in this process; TTFT is the first piece.

Requests/s and mean/p95 TTFT, median of ``--repeats`` runs (the two alternate).

    python benchmarks/server.py http --clients 1 8 32 --repeats 3
    python benchmarks/server.py coldstart --passages 8 --requests 5   # starts its own redis-server
    python benchmarks/server.py affinity --groups 8 --rounds 4        # Ray Serve, 2 replicas, its own redis-server

Part ``coldstart``: a replica that just started over a Redis behind a ~2 MB/s link (the tests'
throttling proxy), TTFT of its first ``--requests`` requests (each over another record's
``--passages`` passages, encoded into Redis by another engine) against full prefill.
Writes ``benchmarks/results/server_<part>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder
from serving import records  # HotpotQA records as (question, passages), as the serving benchmark reads them

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"
MODEL = "SmolLM2-135M-Instruct"


def messages(question: str, passages: list[str]) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Answer from these passages.\n\n" + "\n\n".join(passages) + f"\n\nQuestion: {question}"}]


class Server:
    def __init__(self, *args: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "pc_rag.cli", "serve", "--port", str(self.port), *args],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(1200):  # readiness poll: up to 10 minutes (Ray Serve starts replicas one by one)
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not start")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def summary(ttfts: list[float], wall: float) -> dict[str, float]:
    ttfts = sorted(ttfts)
    return {"wall_s": wall, "requests_per_s": len(ttfts) / wall, "ttft_mean_s": statistics.mean(ttfts),
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]}


async def over_http(url: str, bodies: list[dict[str, Any]]) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=len(bodies) + 4)) as client:
        async def one(body: dict[str, Any], start: float) -> float:
            ttft = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if ttft is None and line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                        ttft = time.perf_counter() - start
            assert ttft is not None
            return ttft

        start = time.perf_counter()
        ttfts = await asyncio.gather(*(one(b, start) for b in bodies))
        return summary(list(ttfts), time.perf_counter() - start)


async def in_process(engine: Any, prompts: list[str], new_tokens: int) -> dict[str, float]:
    async def one(prompt: str, start: float) -> float:
        ttft = None
        async for _ in engine.astream(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens):
            if ttft is None:
                ttft = time.perf_counter() - start
        assert ttft is not None
        return ttft

    start = time.perf_counter()
    ttfts = await asyncio.gather(*(one(p, start) for p in prompts))
    return summary(list(ttfts), time.perf_counter() - start)


def http(args: argparse.Namespace) -> dict[str, Any]:
    from pc_rag import PromptCache

    cases = records(args.data, args.skip, max(args.clients), args.passages)
    passages = sorted({p for _, ps in cases for p in ps})
    server = Server()
    try:
        added = httpx.post(server.url + "/v1/collections/docs/documents", timeout=600,
                           json={"documents": [{"id": f"p{i}", "text": t} for i, t in enumerate(passages)]})
        assert added.status_code == 202
        while any(d["status"] != "encoded" for d in httpx.get(server.url + "/v1/collections/docs/documents", params={"limit": 1000}).json()["data"]):
            time.sleep(0.5)
        engine = PromptCache.from_pretrained()
        engine.add_documents(passages, ids=[f"p{i}" for i in range(len(passages))], progress=False)
        out: dict[str, Any] = {"info": run_info(engine, "SmolLM2-135M-Instruct (embedded)"), "settings": vars(args) | {"data": str(args.data)}, "results": {}}
        for n in args.clients:
            chats = [messages(q, ps) for q, ps in cases[:n]]
            bodies = [{"model": MODEL, "messages": m, "max_tokens": args.new_tokens, "min_tokens": args.new_tokens, "stream": True}
                      for m in chats]
            prompts = [engine.render_chat(m) for m in chats]
            asyncio.run(over_http(server.url, bodies[:1]))  # warm both
            asyncio.run(in_process(engine, prompts[:1], args.new_tokens))
            runs: dict[str, list[dict[str, float]]] = {"server": [], "in-process": []}
            for _ in range(args.repeats):
                runs["server"].append(asyncio.run(over_http(server.url, bodies)))
                runs["in-process"].append(asyncio.run(in_process(engine, prompts, args.new_tokens)))
            out["results"][str(n)] = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
            print(n, json.dumps(out["results"][str(n)]), flush=True)
        return out
    finally:
        server.close()


def coldstart(args: argparse.Namespace) -> dict[str, Any]:
    """A replica that just started, its store a Redis behind a ~2 MB/s link: TTFT of its first
    requests (each a different held-out record's passages) against full prefill of the same prompt."""
    import tempfile

    import pc_rag.kv.load_or_compute
    from pc_rag import PromptCache, build_prompt

    sys.path.insert(0, str(ROOT))
    from tests.conftest import RedisServer, ThrottledProxy

    pc_rag.kv.load_or_compute.MIN_SAVING_S = 0.005  # as shipped (the tests' conftest is imported, not its fixtures)
    cases = records(args.data, args.skip, args.requests, args.passages)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "redis").mkdir()
        server = RedisServer(Path(folder) / "redis")
        server.start()
        proxy = ThrottledProxy(server.port, 2e6)
        try:
            writer = PromptCache.from_pretrained(remote_store=server.url)
            prompts = []
            for question, passages in cases:
                names = writer.add_documents(passages, progress=False)
                prompts.append(build_prompt(question, names))
            writer.generate(prompts[0], max_new_tokens=1, use_cache=False)  # warm the model
            replica = PromptCache(writer.model, writer.tokenizer, remote_store=proxy.url, remote_timeout_ms=10000)
            for i, prompt in enumerate(prompts):
                cached = replica.generate(prompt, max_new_tokens=1)
                full = writer.generate(prompt, max_new_tokens=1, use_cache=False)
                rows.append({"request": i + 1, "prompt_tokens": cached.stats.cached_tokens + cached.stats.computed_tokens,
                             "cached_tokens": cached.stats.cached_tokens, "ttft_s": cached.stats.ttft_s, "full_prefill_s": full.stats.ttft_s,
                             "ratio": cached.stats.ttft_s / full.stats.ttft_s})
                print(rows[-1], flush=True)
            rates = replica.costs.snapshot()
        finally:
            proxy.close()
            server.stop()
    return {"info": run_info(writer, "SmolLM2-135M-Instruct (embedded)"), "settings": vars(args) | {"data": str(args.data)},
            "rows": rows, "rates": rates}


def affinity(args: argparse.Namespace) -> dict[str, Any]:
    """Two replicas on Ray Serve over one Redis, each holding about half the documents in memory
    (``--memory-budget-mb``): requests over ``--groups`` records' passages in turn, ``--rounds``
    times; memory-tier hit rate (requests that loaded nothing from Redis, after a replica's first)
    and mean TTFT, with the affinity router and with Ray Serve's default (power of two choices)."""
    import tempfile

    sys.path.insert(0, str(ROOT))
    from tests.conftest import RedisServer

    cases = records(args.data, args.skip, args.groups, args.passages)
    out: dict[str, Any] = {"settings": vars(args) | {"data": str(args.data)}, "results": {}}
    with tempfile.TemporaryDirectory() as folder:
        redis = RedisServer(Path(folder))
        redis.start()
        try:
            for router in ("affinity", "default"):
                budget = ["--memory-budget-mb", str(args.memory_budget_mb)] if args.memory_budget_mb else []
                server = Server("--replicas", "2", "--remote-store", redis.url, "--router", router, *budget)
                try:
                    documents = [{"id": f"r{r}-p{i}", "text": t} for r, (_, ps) in enumerate(cases) for i, t in enumerate(ps)]
                    assert httpx.post(server.url + "/v1/collections/docs/documents", json={"documents": documents}, timeout=600).status_code == 202
                    while len([d for d in httpx.get(server.url + "/v1/collections/docs/documents", params={"limit": 1000}, timeout=600)
                               .json().get("data", []) if d["status"] == "encoded"]) < len(documents):
                        time.sleep(1)
                    last: dict[str, dict] = {}
                    served = counted = 0
                    ttfts = []
                    for _ in range(args.rounds):
                        for question, passages in cases:
                            reply = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
                                "model": MODEL, "messages": messages(question, passages), "max_tokens": 1}).json()
                            replica = reply["pc_rag"]["replica"]
                            ttfts.append(reply["pc_rag"]["ttft_s"])
                            if replica["id"] in last:
                                counted += 1
                                before = last[replica["id"]]
                                served += replica["hits_remote"] == before["hits_remote"] and replica["misses"] == before["misses"]
                            last[replica["id"]] = replica
                    out["results"][router] = {"memory_hit_rate": served / counted, "ttft_mean_s": statistics.mean(ttfts),
                                              "requests": len(ttfts), "replicas_used": len(last)}
                    print(router, out["results"][router], flush=True)
                finally:
                    server.close()
                redis.client().flushall()
        finally:
            redis.stop()
    return out


def table(report: dict[str, Any]) -> str:
    if "results" in report and "affinity" in report["results"]:
        lines = ["| router | memory-tier hit rate | mean TTFT |", "| --- | ---: | ---: |"]
        for router, r in report["results"].items():
            lines.append(f"| {router} | {r['memory_hit_rate']:.0%} | {r['ttft_mean_s']:.3f} s |")
        return "\n".join(lines)
    if "rows" in report:
        lines = ["| request | prompt tokens | cached | TTFT | full prefill | ratio |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in report["rows"]:
            lines.append(f"| {r['request']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_s']:.2f} s | {r['full_prefill_s']:.2f} s "
                         f"| {r['ratio']:.2f}x |")
        return "\n".join(lines)
    lines = ["| clients | server req/s | in-process req/s | server p95 TTFT | in-process p95 TTFT |", "| ---: | ---: | ---: | ---: | ---: |"]
    for n, r in report["results"].items():
        s, p = r["server"], r["in-process"]
        lines.append(f"| {n} | {s['requests_per_s']:.2f} | {p['requests_per_s']:.2f} | {s['ttft_p95_s']:.2f} s | {p['ttft_p95_s']:.2f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["http", "coldstart", "affinity"])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--skip", type=int, default=100, help="HotpotQA-more records skipped (held out from development)")
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=5, help="coldstart: requests, each over another record's passages")
    parser.add_argument("--groups", type=int, default=8, help="affinity: records whose passages are asked about in turn")
    parser.add_argument("--rounds", type=int, default=4, help="affinity: times each record is asked about")
    parser.add_argument("--memory-budget-mb", type=float, default=None, help="affinity: each replica's memory tier (default: unbounded)")
    args = parser.parse_args()
    report = {"http": http, "coldstart": coldstart, "affinity": affinity}[args.part](args)
    out = ROOT / "benchmarks" / "results" / f"server_{args.part}.json"
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
