"""Drop-in detection cost: finding stored module texts inside a plain 4K-token prompt.

The index holds 10,000 module texts (real text: SQuAD paragraphs and stdlib documentation
passages, each made unique by a numbered prefix). The prompt is a LangChain-style stuffed prompt
of about 4,000 tokens holding four of the stored texts among unrelated text. Detection is timed
on its own (the prompt's tokenisation, which full prefill needs too, is timed separately), and
once more after adding one module each time (a corpus growing while it is served: the index
must not rebuild its whole automaton for every added module).

    python benchmarks/dropin.py [--modules 10000] [--runs 50] [--out benchmarks/results/dropin.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from pc_rag.corpus import stdlib_corpus
from pc_rag.model.loading import default_model_dir
from pc_rag.prompt.dropin import ModuleTextIndex

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--data", default=str(ROOT / "benchmarks" / "data"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dropin.json"))
    args = parser.parse_args()

    squad = json.loads((Path(args.data) / "squad_v1.1_dev_super_bowl_50.json").read_text())["data"]
    base = [p["context"] for a in squad for p in a["paragraphs"]] + [p.text for p in stdlib_corpus()]
    texts = [f"[{i}] {base[i % len(base)]}" for i in range(args.modules)]
    index = ModuleTextIndex()
    started = time.perf_counter()
    for i, text in enumerate(texts):
        index.add("docs", f"doc-{i}", text)
    index.find("warm up: builds the automaton")
    build_s = time.perf_counter() - started

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    chosen = [texts[17], texts[4242], texts[9001 % len(texts)], texts[123]]
    filler = " ".join(p.text for p in stdlib_corpus()[::-1])  # unrelated text (not stored with a [i] prefix)
    prompt = "Answer from the context.\n\n" + "\n\n".join(chosen) + "\n\n"
    while len(tokenizer(prompt)["input_ids"]) < 4000:
        prompt += filler[:2000]
        filler = filler[2000:] + filler[:2000]
    prompt += "\n\nQuestion: what is this about?"
    n_tokens = len(tokenizer(prompt)["input_ids"])

    detect, tokenize = [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        matches = index.find(prompt)
        detect.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tokenizer(prompt)
        tokenize.append(time.perf_counter() - t0)
    assert [m.name for m in matches] == ["doc-17", "doc-4242", f"doc-{9001 % len(texts)}", "doc-123"], matches
    add_find = []
    for run in range(args.runs):
        t0 = time.perf_counter()
        index.add("docs", f"added-{run}", f"[added {run}] {base[run % len(base)]}")
        index.find(prompt)
        add_find.append(time.perf_counter() - t0)
    result = {
        "modules": args.modules,
        "prompt_tokens": n_tokens,
        "prompt_chars": len(prompt),
        "found": len(matches),
        "detect_ms_median": statistics.median(detect) * 1000,
        "detect_ms_p95": sorted(detect)[int(0.95 * len(detect)) - 1] * 1000,
        "tokenize_ms_median": statistics.median(tokenize) * 1000,
        "add_then_find_ms_median": statistics.median(add_find) * 1000,
        "index_build_s": build_s,
        "runs": args.runs,
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
