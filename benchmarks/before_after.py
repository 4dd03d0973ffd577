"""Run a benchmark on an earlier commit and on the working tree, alternating, in one run.

    python benchmarks/before_after.py --ref HEAD~3 --rounds 3 -- benchmarks/ttft.py --no-chains --lengths 1024 4096 --runs 3

The earlier commit's ``pc_rag`` (and ``--after``'s, else the working tree's) is exported to a temporary folder (``git archive``) and put first
on ``PYTHONPATH``; the benchmark script is the working tree's for both, so both sides do the same
work. Rounds alternate before/after so that drift of the machine (thermal, other load) hits both
sides alike. Each run writes its JSON (``--out``); this script prints every metric's median per
side and the ratio after/before, and writes them to ``benchmarks/results/before_after_<name>.json``.
Understands the JSON of ``ttft.py`` (TTFT per series and length) and ``throughput.py`` (decode
tokens/s and mean TTFT per mode, shared tokens and batch).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export(ref: str, into: Path, *folders: str) -> Path:
    """``pc_rag/`` (and ``folders``) as they were at ``ref``, under ``into``."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "pc_rag", *folders], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as archive:
        archive.extractall(into, filter="data")
    return into


def resolve(ref: str) -> str:
    """The commit ``ref`` names now (a relative ref like HEAD~1 means nothing later)."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], check=True, capture_output=True, text=True).stdout.strip()


def metrics(result: dict) -> dict[str, float]:
    """The numbers to compare, by a readable name (lower is better for ms, higher for tok/s)."""
    out: dict[str, float] = {}
    for row in result["rows"]:
        if "ttft_ms" in row:
            for series, ms in row["ttft_ms"].items():
                out[f"ttft ms | {row['prompt_tokens']} tokens | {series}"] = ms
        if "modes" in row:
            for mode, values in row["modes"].items():
                where = f"{row['shared_tokens']} shared | batch {row['batch']} | {mode}"
                out[f"decode tok/s | {where}"] = values["decode_tokens_per_s"]
                out[f"mean ttft ms | {where}"] = values["mean_ttft_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", required=True, help="the earlier commit (before)")
    parser.add_argument("--after", default=None, help="a commit for the after side (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scripts-from-ref", action="store_true",
                        help="run the benchmark script as it was at --ref on the before side (when internal modules moved between them; "
                             "the two scripts must do the same work)")
    parser.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- script.py [its arguments]")
    args = parser.parse_args()
    command = [a for a in args.benchmark if a != "--"]
    if not command:
        parser.error("give the benchmark after --")
    name = Path(command[0]).stem
    with tempfile.TemporaryDirectory(prefix="pc-rag-before-") as tmp:
        before = export(args.ref, Path(tmp) / "before", *(["benchmarks"] if args.scripts_from_ref else []))
        after = export(args.after, Path(tmp) / "after") if args.after else ROOT
        sides = {"before": str(before), "after": str(after)}
        scripts = {"before": str(before / command[0]) if args.scripts_from_ref else command[0], "after": command[0]}
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for round_ in range(args.rounds):
            for side, path in sides.items():
                out = Path(tmp) / f"{side}-{round_}.json"
                env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
                print(f"round {round_ + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                subprocess.run([sys.executable, scripts[side], *command[1:], "--out", str(out)], check=True, env=env, cwd=ROOT)
                runs[side].append(metrics(json.loads(out.read_text())))
    report = {"ref": resolve(args.ref), "after": resolve(args.after) if args.after else "working tree", "rounds": args.rounds,
              "command": command, "scripts_from_ref": args.scripts_from_ref, "metrics": {}}
    print(f"{'metric':70} {'before':>10} {'after':>10} {'after/before':>12}")
    for key in runs["before"][0]:
        before_value = statistics.median(r[key] for r in runs["before"])
        after_value = statistics.median(r[key] for r in runs["after"] if key in r)
        ratio = after_value / before_value if before_value else float("nan")
        report["metrics"][key] = {"before": before_value, "after": after_value, "ratio": ratio}
        print(f"{key:70} {before_value:10.1f} {after_value:10.1f} {ratio:12.3f}")
    target = ROOT / "benchmarks" / "results" / f"before_after_{name}.json"
    target.write_text(json.dumps(report, indent=1))
    print(f"wrote {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
