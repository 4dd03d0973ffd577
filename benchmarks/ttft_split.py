"""Where a cached prompt's first token goes: assembly, products, attention and the rest, at each length.

``ttft.py``'s prompts (the SQuAD "Super_Bowl_50" paragraphs pasted into one chat turn, their documents
cached), the default engine. Timers wrap every linear layer's forward on pc-rag's blocks (products)
and pc-rag's attention function (attention); assembly is the result's ``stats.assemble_s``; the rest
(norms, rotations, activations, Python) is what the first token took besides. Medians of ``--runs``.

    python benchmarks/ttft_split.py --lengths 1024 4096 7680 --runs 5
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ttft import cached_paragraphs, chat_prompt

from pc_rag import PromptCache
from pc_rag.forward import attention
from pc_rag.weights.blocks import BlockLinear

ROOT = Path(__file__).resolve().parents[1]
spent: collections.Counter[str] = collections.Counter()


def timed(name: str, call: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 7680])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    args = parser.parse_args()
    attention._attention = timed("attention", attention._attention)
    BlockLinear.forward = timed("products", BlockLinear.forward)
    engine = PromptCache.from_pretrained(kv_dir=tempfile.mkdtemp(prefix="pc-rag-split-"))
    texts, sizes = cached_paragraphs([engine], args.data, max(args.lengths))
    print("| prompt tokens | computed | TTFT | assembly | products | attention | norms, rotations, activations, Python |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for target in args.lengths:
        prompt, _ = chat_prompt(engine, texts, sizes, target)
        plan = engine.plan(prompt)
        engine.generate(prompt, max_new_tokens=1)  # warm-up
        runs = []
        for _ in range(args.runs):
            spent.clear()
            stats = engine.generate(prompt, max_new_tokens=1).stats
            runs.append((stats.ttft_s, stats.assemble_s, spent["products"], spent["attention"]))
        ttft, assembly, products, attended = (1000 * statistics.median(run[i] for run in runs) for i in range(4))
        print(f"| {len(plan.input_ids)} | {plan.computed_tokens} | {ttft:.0f} ms | {assembly:.0f} ms | {products:.0f} ms | "
              f"{attended:.0f} ms | {ttft - assembly - products - attended:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
