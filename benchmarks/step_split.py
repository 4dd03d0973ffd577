"""One C decode step of the embedded model in isolation: 1 and 8 rows, each with 20 own entries, without and
with 1,024 shared entries read in place by all rows (random KV; medians of 15): what the products and the rest
cost against what attention over shared KV adds.

    python benchmarks/step_split.py
    python benchmarks/step_split.py --ref HEAD~1 --rounds 7

``--ref``: the same steps on another commit's kernels (``pc_rag/kernels`` as it was there, built by its own
build script) and on this tree's, alternating call by call in one process on one engine, so the host's
drift (up to 1.5x between processes here) hits both alike. The two must share the step's structure
layout (the load check refuses one that does not).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from pc_rag import PromptCache
from pc_rag.forward import shared_attention
from pc_rag.forward.rotation import RopeRotator
from pc_rag.kernels import loader
from pc_rag.kv.buffers import KVBuffer

ROOT = Path(__file__).resolve().parents[1]
CASES = [(rows, shared) for rows in (1, 8) for shared in (1, 1024)]


def timed_step(step, model, rows: int, shared: int, own: int = 20, repeats: int = 15) -> float:
    """Median ms of one step of ``rows`` rows over ``own`` entries each and ``shared`` entries they all read."""
    layers, kv_heads = len(step.layers), step.kv_heads
    dim = step.layers[0].q.out_features // step.heads
    buffer = KVBuffer.for_model(model, own + 1, batch=rows)
    buffer.storage.copy_(torch.randn(buffer.storage.shape) * 0.3)
    buffer.grow_to(own)
    buffer.fix(own + 1, torch.tensor([own]))
    part = shared_attention.SharedPart(torch.randn(layers, 2, kv_heads, shared, dim) * 0.3, torch.arange(shared), slice(0, rows))
    kv = shared_attention.SharedKV([part], heads_per_kv=step.heads // kv_heads, dtype=torch.float32, rotator=RopeRotator(model))
    ids, positions = torch.full((rows, 1), 7), torch.full((rows, 1), shared + own)
    mask = torch.ones(rows, 1, 1, own + 1, dtype=torch.bool)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step(ids, positions, mask, buffer.cache, shared=kv.for_queries(positions, (shared + own, shared + own)))
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def kernels_at(ref: str) -> Path:
    """The kernels library of commit ``ref``: its ``pc_rag`` exported and its loader run in a child process."""
    folder = Path(tempfile.mkdtemp(prefix="pc-rag-ref-"))
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "pc_rag"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as archive:
        archive.extractall(folder, filter="data")
    env = {**os.environ, "PYTHONPATH": str(folder), "PC_RAG_KERNELS": "build"}
    found = subprocess.run([sys.executable, "-c", "from pc_rag.kernels import loader; print(loader.library()._name)"],
                           check=True, capture_output=True, text=True, env=env, cwd=folder)
    return Path(found.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", help="alternate with this commit's kernels in one process")
    parser.add_argument("--rounds", type=int, default=1, help="alternations (medians over them)")
    parser.add_argument("--out", type=Path, help="write the medians here as JSON")
    args = parser.parse_args()
    engine = PromptCache.from_pretrained()
    step = engine.forward.written_step
    libs = {"this tree": step.fused.lib}
    if args.ref:
        libs = {args.ref: loader.load_file(kernels_at(args.ref)), **libs}
    before = step.fused.steps
    times: dict[tuple[str, int, int], list[float]] = {(name, *case): [] for name in libs for case in CASES}
    for round_ in range(args.rounds):
        for rows, shared in CASES:
            for name, lib in list(libs.items())[:: 1 if round_ % 2 == 0 else -1]:  # each side first in turn
                step.fused.lib = lib
                times[(name, rows, shared)].append(timed_step(step, engine.model, rows, shared, repeats=15 if args.rounds == 1 else 5))
    table = []
    for rows, shared in CASES:
        medians = {name: statistics.median(times[(name, rows, shared)]) for name in libs}
        line = ", ".join(f"{name} {ms:.1f} ms" for name, ms in medians.items())
        if shared > 1:  # what the shared entries add: paired round by round with the same side's step without them
            added = {name: statistics.median(a - b for a, b in zip(times[(name, rows, shared)], times[(name, rows, 1)])) for name in libs}
            line += "; attention over them " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in added.items())
            medians = {**medians, **{f"{name}, attention over the shared entries": ms for name, ms in added.items()}}
            if args.ref:
                line += f" (this tree / {args.ref}: {added['this tree'] / added[args.ref]:.2f})"
        elif args.ref:
            line += f" (this tree / {args.ref}: {medians['this tree'] / medians[args.ref]:.2f})"
        table.append({"rows": rows, "shared_entries": shared, "ms": medians})
        print(f"{rows} rows, {shared} shared entries: {line}", flush=True)
    print(f"steps run in C: {step.fused.steps - before}")
    if args.out:
        args.out.write_text(json.dumps({"ref": args.ref, "rounds": args.rounds, "steps": table}, indent=1))


if __name__ == "__main__":
    main()
