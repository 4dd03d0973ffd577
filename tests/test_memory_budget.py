"""Resident memory under a memory budget, measured in a separate process.

The worker (tests/workers/memory_worker.py) serves 100 documents whose KV is about 4.8x the
budget; every document is imported by some query, so most are evicted to the disk tier and
loaded back. Its resident-set high-water mark may grow past the warmed-up process by at most
the budget plus a stated slack: one request's KV buffer (32 MiB: 1,024 tokens of 32 KiB),
one encoding batch's buffer (~14 MiB), a module being written or read (~6 MiB) and allocator
overhead. Were nothing evicted, the growth would exceed the corpus size (~612 MiB).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MiB = 1 << 20
BUDGET = 128 * MiB
SLACK = 96 * MiB
WORKER = Path(__file__).parent / "workers" / "memory_worker.py"


def test_resident_memory_stays_under_model_plus_budget_plus_slack(model_dir):
    out = subprocess.run([sys.executable, str(WORKER), str(model_dir), str(BUDGET)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["corpus_bytes"] >= 3 * BUDGET  # the corpus cannot fit
    assert report["memory_bytes"] <= BUDGET
    assert report["disk_loads"] > 0 and report["encoded"] == 101  # evicted, reloaded, never re-encoded
    growth = report["peak"] - report["base"]
    assert growth <= BUDGET + SLACK, f"resident memory grew {growth / MiB:.0f} MiB for a {BUDGET / MiB:.0f} MiB budget"
