"""Real processes sharing one kv_dir: killed mid-write, and encoding at the same time.

Each worker (tests/workers/cache_worker.py) encodes 40 documents one call at a time into the
kv_dir and answers 5 questions over them. Whatever the workers did to the cache, a later
process must load only complete entries, encode the rest, and answer exactly like a process
that never touched a cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from pc_rag import PromptCache, build_prompt
from tests.workers.cache_worker import DOCUMENTS, QUESTIONS

WORKER = Path(__file__).parent / "workers" / "cache_worker.py"
ENTRIES = len(DOCUMENTS) + 1  # + the system prompt the documents are encoded behind


def start(model: Path, kv_dir: Path, order: str = "forward", kill_at: int = 0) -> subprocess.Popen:
    args = [sys.executable, str(WORKER), str(model), str(kv_dir), order] + ([str(kill_at)] if kill_at else [])
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def complete_entries(kv_dir: Path) -> int:
    """Entries a later process would trust: a manifest whose data file has its size and checksum."""
    trusted = 0
    for manifest in kv_dir.rglob("*.json"):
        record = json.loads(manifest.read_text())
        blob = manifest.with_suffix(".safetensors").read_bytes()
        assert len(blob) == record["bytes"] and zlib.crc32(blob) == record["crc32"], f"{manifest.name} describes a broken file"
        trusted += 1
    return trusted


@pytest.fixture
def reference(saved_model) -> list[list[int]]:
    """Answers of a process that never used a kv_dir."""
    engine = PromptCache.from_pretrained(saved_model)
    engine.forward.decode_threads.fixed = 1  # as the workers hold it (tests/workers/cache_worker.py says why)
    names = engine.add_documents(DOCUMENTS, progress=False)
    return [engine.generate(build_prompt(q, [names[d] for d in docs]), max_new_tokens=6).token_ids for q, docs in QUESTIONS]


def test_processes_killed_mid_write_leave_nothing_trusted_that_is_broken(saved_model, tmp_path, reference):
    kv_dir = tmp_path / "cache"
    # fsync 3: a KV file complete but never renamed; fsync 8: a KV file renamed, its manifest not;
    # the second kill happens in a process that first loads what the first one left
    for kill_at in (3, 8):
        proc = start(saved_model, kv_dir, kill_at=kill_at)
        proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL
        complete_entries(kv_dir)  # every manifest on disk describes a complete file
    # a kill at an arbitrary moment of the encoding loop (not chosen by the worker)
    proc = start(saved_model, kv_dir, order="reverse")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)  # the worker has just started encoding
    proc.communicate(timeout=300)
    survived = complete_entries(kv_dir)
    assert 0 < survived < ENTRIES

    orphans = [p for p in kv_dir.rglob("*") if p.name.endswith(".tmp")]
    assert orphans  # the deterministic kills left temporary files ...
    for path in orphans:  # ... which a later process removes once they are old enough to be dead
        os.utime(path, (time.time() - 7200, time.time() - 7200))

    result = finish(start(saved_model, kv_dir))
    assert result["answers"] == reference
    assert result["encoded"] == ENTRIES - survived  # what survived was loaded, the rest encoded
    assert complete_entries(kv_dir) == ENTRIES
    assert not [p for p in kv_dir.rglob("*") if p.name.endswith(".tmp")]


def test_two_processes_encoding_into_one_kv_dir_agree(saved_model, tmp_path, reference):
    kv_dir = tmp_path / "cache"
    # opposite orders: they meet in the middle, writing the same entries at the same time
    first, second = start(saved_model, kv_dir, "forward"), start(saved_model, kv_dir, "reverse")
    results = [finish(first), finish(second)]
    assert [r["answers"] for r in results] == [reference, reference]
    assert sum(r["encoded"] for r in results) >= ENTRIES  # between them they encoded everything
    assert complete_entries(kv_dir) == ENTRIES
    assert not [p for p in kv_dir.rglob("*") if p.name.endswith(".tmp")]
    third = finish(start(saved_model, kv_dir))  # a consistent cache: a third process encodes nothing
    assert third["encoded"] == 0 and third["answers"] == reference
