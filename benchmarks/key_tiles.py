"""A cached prompt's first token with its prefill attending by tiles of keys (:mod:`pc_rag.forward.key_tiles`)
against one attention call over every key, alternating call by call in one process on one engine.

The prompts are ``ttft.py``'s (the SQuAD "Super_Bowl_50" paragraphs pasted into one chat turn up to
each length, its documents cached). Each round runs every length once with tiles and once without
(``key_tiles.MIN_KEYS`` set past any prompt), so the machine's drift hits both alike; medians per side.

    python benchmarks/key_tiles.py --lengths 1024 4096 7680 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder
from ttft import cached_paragraphs, chat_prompt

from pc_rag import PromptCache
from pc_rag.forward import key_tiles

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 7680])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "key_tiles.json")
    args = parser.parse_args()
    engine = PromptCache.from_pretrained(kv_dir=tempfile.mkdtemp(prefix="pc-rag-tiles-"))
    texts, sizes = cached_paragraphs([engine], args.data, max(args.lengths))
    sides = {"one call": 10**9, "tiles": key_tiles.MIN_KEYS}
    rows = []
    for target in args.lengths:
        prompt, _ = chat_prompt(engine, texts, sizes, target)
        plan = engine.plan(prompt)
        times: dict[str, list[float]] = {side: [] for side in sides}
        answers: dict[str, str] = {}
        engine.generate(prompt, max_new_tokens=1)  # warm-up
        for _ in range(args.rounds):
            for side, keys in sides.items():
                key_tiles.MIN_KEYS = keys
                result = engine.generate(prompt, max_new_tokens=8)
                times[side].append(result.stats.ttft_s)
                answers[side] = result.text
        key_tiles.MIN_KEYS = sides["tiles"]
        medians = {side: 1000 * statistics.median(t) for side, t in times.items()}
        row = {"prompt_tokens": len(plan.input_ids), "computed_tokens": plan.computed_tokens, "ttft_ms": medians,
               "tiles_over_one_call": medians["tiles"] / medians["one call"], "same_answer": answers["tiles"] == answers["one call"]}
        rows.append(row)
        print(f"{row['prompt_tokens']:5d} tokens ({row['computed_tokens']} computed): one call {medians['one call']:.0f} ms, "
              f"tiles {medians['tiles']:.0f} ms ({row['tiles_over_one_call']:.2f}x), same answer: {row['same_answer']}", flush=True)
    args.out.write_text(json.dumps({"run": run_info(engine, "SmolLM2-135M-Instruct (embedded)"), "rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
