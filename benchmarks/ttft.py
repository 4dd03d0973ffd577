"""TTFT of cached inference against full prefill of the same tokens, measured in one run.

Modules are the paragraphs of the SQuAD v1.1 article "Super_Bowl_50" (real text); each context
length imports the first paragraphs until it holds that many module tokens, then asks a short
question. Reports medians over ``--runs`` runs (after one warm-up) and writes JSON.

    python benchmarks/ttft.py                      # embedded SmolLM2-135M on this machine
    python benchmarks/ttft.py --device cuda --model PATH
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from pc_rag import PromptCache
from pc_rag.pml import escape

QUESTION = "Which team won the game, and what was the final score?"


def paragraphs(data: Path) -> list[str]:
    article = json.loads((data / "squad_v1.1_dev_super_bowl_50.json").read_text())["data"][0]
    return [p["context"] for p in article["paragraphs"]]


def build_schema(texts: list[str]) -> str:
    modules = "\n".join(f'<module name="p{i}">{escape(t)}\n</module>' for i, t in enumerate(texts))
    return f'<schema name="bench"><system>Answer the question from the passages.</system><user>\n{modules}\n</user></schema>'


def measure(engine: PromptCache, prompt: str, use_cache: bool, runs: int) -> dict[str, float]:
    engine.generate(prompt, max_new_tokens=1, use_cache=use_cache)  # warm-up
    ttft, assemble = [], []
    for _ in range(runs):
        stats = engine.generate(prompt, max_new_tokens=1, use_cache=use_cache).stats
        ttft.append(stats.ttft_s)
        assemble.append(stats.assemble_s)
    return {"ttft_s": statistics.median(ttft), "assemble_s": statistics.median(assemble), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared" / "data")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 7680])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "ttft.json")
    args = parser.parse_args()

    engine = PromptCache.from_pretrained(args.model, device=args.device)
    texts, budget = [], max(args.lengths) + 64
    for text in paragraphs(args.data):  # as many paragraphs as the longest context needs
        budget -= len(engine.tokenize(text)) + 1
        if budget < 0:
            break
        texts.append(text)
    schema = engine.add_schema(build_schema(texts))
    sizes = [len(schema.layout.modules[f"p{i}"].token_ids) for i in range(len(texts))]
    rows = []
    for target in args.lengths:
        count, total = 0, 0
        while count < len(sizes) and total + sizes[count] <= target:
            total += sizes[count]
            count += 1
        refs = "".join(f"<p{i}/>" for i in range(count))
        prompt = f'<prompt schema="bench">{refs}<user>{escape(QUESTION)}</user></prompt>'
        plan = engine.plan(prompt)
        cached = measure(engine, prompt, True, args.runs)
        full = measure(engine, prompt, False, args.runs)
        row = {
            "target_tokens": target,
            "module_tokens": total,
            "prompt_tokens": len(plan.input_ids),
            "computed_tokens": plan.computed_tokens,
            "cached": cached,
            "full_prefill": full,
            "speedup": full["ttft_s"] / cached["ttft_s"],
            "assembly_share": cached["assemble_s"] / cached["ttft_s"],
        }
        rows.append(row)
        print(
            f"{total:5d} module tokens: full {full['ttft_s'] * 1000:8.1f} ms | cached {cached['ttft_s'] * 1000:7.1f} ms "
            f"(assembly {row['assembly_share']:.0%}) | speedup {row['speedup']:5.1f}x",
            flush=True,
        )
    result = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "encoding": engine.encoding,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
