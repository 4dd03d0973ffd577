"""``pc-rag serve`` as a real process on a free port, for the server tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"  # the id `pc-rag serve` gives the embedded model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``pc-rag serve ARGS`` on 127.0.0.1, ready once ``/health`` answers."""

    def __init__(self, folder: Path, *args: str, keys: dict[str, object] | None = None, startup_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "pc_rag.cli", "serve", "--port", str(self.port), *args]
        if keys is not None:
            key_file = folder / "keys.json"
            key_file.write_text(json.dumps(keys))
            command += ["--api-keys", str(key_file)]
        self.log = folder / "server.log"
        self._log = self.log.open("wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + startup_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pc-rag serve exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"pc-rag serve did not answer within {startup_s} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of ``/metrics`` (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    def wait_for(self, condition, what: str, timeout: float = 120.0) -> None:
        """Poll ``condition()`` until true (a deadline, not a timing assertion)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s")
            time.sleep(0.1)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
