"""A soak as an operator runs one before going live: ``pc-rag serve`` with two tenants' keys, many
clients for minutes, documents added and deleted while they are asked about.

Two phases of equal length, the same clients in both:

- ``quiet``: tenant A's clients chat with passages pasted into the message (no document traffic);
- ``documents``: tenant A's clients add passages as documents, ask about them by id (often while
  they are still queued), delete them (often while queued), abandon streams and send bad input.

Tenant B's clients chat the same way in both phases; B's p95 latency in ``documents`` over its p95
in ``quiet`` is what A's document traffic costs the other tenant. A watcher lists A's collection
twice a second: a document's time to ``encoded`` is from its POST's answer to the first listing that
says so. At the end every document added and not deleted must be ``encoded`` (within ``--drain-s``)
and none deleted listed.

    python benchmarks/soak.py --minutes 8 --clients 12             # README's run (twice)
    python benchmarks/soak.py --minutes 0.5 --clients 6 --out X     # what tests/test_soak.py runs

Writes a JSON summary (``--out``; default benchmarks/results/soak.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
SQUAD = HERE / "data" / "squad_v1.1_dev_super_bowl_50.json"
MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B = "soak-tenant-a-key-0001", "soak-tenant-b-key-0002"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Soak:
    """The clients, the watcher and what they saw."""

    def __init__(self, url: str, passages: list[str], seed: int) -> None:
        self.url, self.passages = url, passages
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.phase = "quiet"
        self.stop = threading.Event()
        self.latencies: dict[tuple[str, str], list[float]] = {}  # (tenant, phase) -> seconds of each answered request
        self.statuses: dict[int, int] = {}
        self.malformed: list[str] = []  # errors not in OpenAI's shape
        self.added: dict[str, float] = {}  # document id -> when its POST was answered
        self.encoded_after: dict[str, float] = {}  # document id -> seconds to "encoded"
        self.deleted: set[str] = set()
        self.delete_s: list[float] = []
        self.counter = 0

    # -- requests ---------------------------------------------------------------------------
    def request(self, client: httpx.Client, key: str, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response | None, float]:
        started = time.monotonic()
        try:
            response = client.request(method, self.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=180, **kwargs)
        except httpx.HTTPError as err:
            with self.lock:
                self.malformed.append(f"{method} {path}: {type(err).__name__}")
            return None, time.monotonic() - started
        seconds = time.monotonic() - started
        with self.lock:
            self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
            if response.status_code >= 400:
                try:
                    error = response.json()["error"]
                    assert isinstance(error["message"], str) and "type" in error
                except Exception:  # noqa: BLE001 - anything not OpenAI-shaped is counted
                    self.malformed.append(f"{method} {path} -> {response.status_code}: {response.text[:120]}")
                if response.status_code == 429 and "retry-after" not in response.headers:
                    self.malformed.append(f"{method} {path} -> 429 without Retry-After")
        return response, seconds

    def chat(self, client: httpx.Client, key: str, tenant: str, content: str, **extra: Any) -> None:
        phase = self.phase
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}
        response, seconds = self.request(client, key, "POST", "/v1/chat/completions", json=body)
        if response is not None and response.status_code == 200:
            with self.lock:
                self.latencies.setdefault((tenant, phase), []).append(seconds)

    def passage(self) -> str:
        return self.random.choice(self.passages)

    # -- the clients -------------------------------------------------------------------------
    def tenant_b(self) -> None:
        with httpx.Client() as client:
            while not self.stop.is_set():
                self.chat(client, KEY_B, "b", f"{self.passage()}\n\nIn one word, what is this about?")

    def tenant_a(self) -> None:
        with httpx.Client() as client:
            while not self.stop.is_set():
                if self.phase == "quiet":
                    self.chat(client, KEY_A, "a", f"{self.passage()}\n\nIn one word, what is this about?")
                else:
                    self.document_traffic(client)

    def document_traffic(self, client: httpx.Client) -> None:
        roll = self.random.random()
        with self.lock:
            live = [name for name in self.added if name not in self.deleted]
        if roll < 0.3 or not live:
            with self.lock:
                self.counter += 1
                name = f"soak-{self.counter}"
            response, _ = self.request(client, KEY_A, "POST", "/v1/collections/alpha/documents",
                                       json={"documents": [{"id": name, "text": self.passage() + f" (copy {self.counter})"}]})
            if response is not None and response.status_code == 202:
                with self.lock:
                    self.added[name] = time.monotonic()
        elif roll < 0.65:
            self.chat(client, KEY_A, "a", "In one word, what is this about?", documents=[self.random.choice(live)], collection="alpha")
        elif roll < 0.8:
            name = self.random.choice(live)
            response, seconds = self.request(client, KEY_A, "DELETE", f"/v1/collections/alpha/documents/{name}")
            if response is not None and response.status_code == 200:
                with self.lock:
                    self.deleted.add(name)
                    self.delete_s.append(seconds)
        elif roll < 0.9:  # a stream abandoned after its first piece
            body = {"model": MODEL, "messages": [{"role": "user", "content": self.passage()}], "max_tokens": 64, "stream": True}
            try:
                with client.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=180,
                                   headers={"Authorization": f"Bearer {KEY_A}"}) as stream:
                    next(stream.iter_lines(), None)
            except httpx.HTTPError:
                pass
        else:  # bad input: a body that is not JSON, an unknown document, another tenant's collection
            kind = self.random.randrange(3)
            if kind == 0:
                self.request(client, KEY_A, "POST", "/v1/chat/completions", content=b"{not json")
            elif kind == 1:
                self.chat(client, KEY_A, "a", "Hi", documents=["no-such-document"], collection="alpha")
            else:
                self.chat(client, KEY_A, "a", "Hi", documents=["x"], collection="beta")

    def watcher(self) -> None:
        with httpx.Client() as client:
            while not self.stop.is_set():
                self.look(client)
                self.stop.wait(0.5)

    def look(self, client: httpx.Client) -> dict[str, str]:
        response = client.get(self.url + "/v1/collections/alpha/documents", params={"limit": 1000},
                              headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
        listed = {d["id"]: d["status"] for d in response.json()["data"]} if response.status_code == 200 else {}
        now = time.monotonic()
        with self.lock:
            for name, status in listed.items():
                if status == "encoded" and name in self.added and name not in self.encoded_after:
                    self.encoded_after[name] = now - self.added[name]
        return listed


def run(minutes: float, clients: int, seed: int, drain_s: float, extra: list[str]) -> dict[str, Any]:
    passages = [p["context"] for article in json.loads(SQUAD.read_text())["data"] for p in article["paragraphs"]]
    port = _free_port()
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys.json"
        keys.write_text(json.dumps({KEY_A: ["alpha"], KEY_B: ["beta"]}))
        log = (Path(folder) / "server.log").open("wb")
        server = subprocess.Popen([sys.executable, "-m", "pc_rag.cli", "serve", "--port", str(port), "--api-keys", str(keys),
                                   "--max-running", "4", "--max-queued", "16", *extra], stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_up(server, url)
            soak = Soak(url, passages, seed)
            threads = [threading.Thread(target=soak.tenant_a if i % 2 == 0 else soak.tenant_b) for i in range(clients)]
            threads.append(threading.Thread(target=soak.watcher))
            for thread in threads:
                thread.start()
            half = minutes * 30.0
            time.sleep(half)  # the quiet phase runs for its length (a benchmark's clock, not a test's assertion)
            soak.phase = "documents"
            time.sleep(half)
            soak.stop.set()
            for thread in threads:
                thread.join()
            summary = _summary(soak, url, drain_s)
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
    return summary


def _wait_until_up(server: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"pc-rag serve exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("pc-rag serve did not start within 300 s")


def _summary(soak: Soak, url: str, drain_s: float) -> dict[str, Any]:
    """What the clients saw, once the documents left are encoded (or ``drain_s`` passed)."""
    with httpx.Client() as client:
        end = time.monotonic() + drain_s
        while True:
            listed = soak.look(client)
            waiting = [n for n in soak.added if n not in soak.deleted and listed.get(n) != "encoded"]
            if not waiting or time.monotonic() > end:
                break
            time.sleep(0.5)
    b = {phase: soak.latencies.get(("b", phase), []) for phase in ("quiet", "documents")}
    p95 = {phase: _percentile(values, 0.95) for phase, values in b.items()}
    encoded = list(soak.encoded_after.values())
    every = [s for values in soak.latencies.values() for s in values]
    return {
        "requests": sum(soak.statuses.values()),
        "statuses": {str(k): v for k, v in sorted(soak.statuses.items())},
        "server_errors": sum(v for k, v in soak.statuses.items() if k >= 500),
        "malformed_errors": soak.malformed[:20],
        "max_latency_s": max(every, default=None),
        "tenant_b": {phase: {"requests": len(values), "p50_s": _percentile(values, 0.5), "p95_s": p95[phase]} for phase, values in b.items()},
        "tenant_b_p95_ratio": (p95["documents"] / p95["quiet"]) if p95["quiet"] and p95["documents"] else None,
        "documents_added": len(soak.added),
        "documents_deleted": len(soak.deleted),
        "never_encoded": sorted(n for n in soak.added if n not in soak.deleted and listed.get(n) != "encoded"),
        "deleted_but_listed": sorted(n for n in soak.deleted if n in listed),
        "time_to_encoded_s": {"p50": _percentile(encoded, 0.5), "p95": _percentile(encoded, 0.95), "max": max(encoded, default=None)},
        "delete_s": {"p50": _percentile(soak.delete_s, 0.5), "p95": _percentile(soak.delete_s, 0.95), "max": max(soak.delete_s, default=None)},
        "mean_latency_s": statistics.fmean(every) if every else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=8.0, help="both phases together")
    parser.add_argument("--clients", type=int, default=12, help="half tenant A's, half tenant B's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drain-s", type=float, default=120.0, help="how long the documents left may take to be encoded at the end")
    parser.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    parser.add_argument("serve_args", nargs="*", help="more `pc-rag serve` options (after --)")
    args = parser.parse_args()
    summary = run(args.minutes, args.clients, args.seed, args.drain_s, args.serve_args)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
