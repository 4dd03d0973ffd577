"""A short soak (``benchmarks/soak.py``, about a minute): two tenants' clients against ``pc-rag serve``,
tenant A's documents added, asked about and deleted while they are queued, tenant B chatting
throughout. README's figures come from the same script run for 8 minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_documents_under_load_are_encoded_deleted_and_nothing_fails(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "1", "--clients", "6", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["server_errors"] == 0 and summary["malformed_errors"] == []
    assert summary["documents_added"] > 0 and summary["documents_deleted"] > 0
    assert summary["never_encoded"] == [] and summary["deleted_but_listed"] == []  # every document encoded, none deleted back
    assert summary["max_latency_s"] < 120  # no request waits out the old 120 s document wait
    assert summary["delete_s"]["max"] is not None
    assert all(summary["tenant_b"][phase]["requests"] > 0 for phase in ("quiet", "documents"))
