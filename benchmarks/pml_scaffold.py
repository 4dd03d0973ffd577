"""Fidelity on the PML path: joint ("scaffold") encoding beside per-module encodings and recovery.

HotpotQA (distractor): each record becomes a PML schema whose 10 paragraphs are 10 modules, in
the dataset's order, after a system turn. The prompt imports the two supporting paragraphs and
the first two distractors, in schema order (so some modules between them are skipped, as a
retrieval-driven prompt over a fixed schema would), then asks the question. Every variant is
compared with full prefill of the very same tokens (first-token agreement, first-token KL,
whole-answer agreement, mean TTFT and speedup; metrics as in ``benchmarks/quality.py``).

    python benchmarks/pml_scaffold.py [--records 20] [--variants scaffold:0:0 shared_prefix:4:1 ...]

A variant is ``ENCODING:HEAD:TAIL`` (recovery: the first HEAD and last TAIL tokens of every moved
module recomputed). Writes ``benchmarks/results/pml_scaffold.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from quality import INSTRUCTION, answer, summarize  # benchmarks/quality.py (this folder is on sys.path)
from run_info import run_info
from tqdm.auto import tqdm

from pc_rag import PML, PromptCache, escape
from pc_rag.model.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "Answer the question from the paragraphs."


def schema_and_prompt(record: dict, name: str) -> tuple[str, PML]:
    titles = [title for title, _ in record["context"]]
    gold = {title for title, _ in record["supporting_facts"]}
    modules = "\n".join(
        f'<module name="p{i}">{escape(title)}: {escape("".join(sentences).strip())}\n\n</module>'
        for i, (title, sentences) in enumerate(record["context"])
    )
    schema = f'<schema name="{name}"><system>{escape(SYSTEM)}</system><user>{modules}</user></schema>'
    chosen = [i for i, title in enumerate(titles) if title in gold]
    chosen += [i for i, title in enumerate(titles) if title not in gold][:2]
    refs = "".join(f"<p{i}/>" for i in sorted(chosen))
    return schema, PML(f'<prompt schema="{name}"><user>{refs}{escape(record["question"] + INSTRUCTION)}</user></prompt>')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=["isolated:0:0", "shared_prefix:0:0", "shared_prefix:4:1", "scaffold:0:0", "scaffold:4:1"])
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pml_scaffold.json")
    args = parser.parse_args()
    records = [json.loads(line) for line in (args.data / "hotpotqa_dev_distractor_53.jsonl").read_text().splitlines()[: args.records]]
    model, tokenizer = load_model(None)
    variants = {}
    for spec in args.variants:
        encoding, head, tail = spec.split(":")
        variants[spec] = PromptCache(model, tokenizer, encoding=encoding, recompute=int(head), recompute_tail=int(tail))
    prompts = []
    encode_s = {spec: 0.0 for spec in variants}
    for index, record in enumerate(tqdm(records, desc="schemas", unit="record")):
        schema, prompt = schema_and_prompt(record, f"hotpot{index}")
        prompts.append(prompt)
        for spec, engine in variants.items():
            started = time.perf_counter()
            engine.add_schema(schema, progress=False)
            encode_s[spec] += time.perf_counter() - started
    first = next(iter(variants.values()))
    full = [answer(first, p, use_cache=False, max_new_tokens=args.max_new_tokens) for p in tqdm(prompts, desc="full prefill")]
    golds = [[r["answer"]] for r in records]
    table = {"full prefill": summarize(full, full, golds)}
    for spec, engine in variants.items():
        rows = [answer(engine, p, use_cache=True, max_new_tokens=args.max_new_tokens) for p in tqdm(prompts, desc=spec)]
        table[spec] = summarize(rows, full, golds)
        table[spec]["encode_s_per_record"] = encode_s[spec] / len(records)
        table[spec]["computed_tokens"] = sum(engine.plan(p).computed_tokens for p in prompts) / len(prompts)
    prompt_tokens = sum(len(first.plan(p).input_ids) for p in prompts) / len(prompts)
    result = {**run_info(first, "SmolLM2-135M-Instruct (embedded)"), "records": len(records), "prompt_tokens": prompt_tokens, "variants": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    lines = [
        f"HotpotQA, {len(records)} records as PML schemas, ~{prompt_tokens:.0f}-token prompts (4 of 10 paragraphs imported)",
        "",
        "| variant | 1st token = full | decisive | KL | answer = full | computed tokens | TTFT | speedup | encode / record |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in table.items():
        lines.append(
            f"| {name} | {row['first_token_agreement']:.1f}% | {row['decisive_agreement']:.1f}% ({row['decisive_questions']}) | "
            f"{row['first_token_kl']:.3f} | {row['answer_agreement']:.1f}% | {row.get('computed_tokens', prompt_tokens):.0f} | "
            f"{row['mean_ttft_ms']:.0f} ms | {row['speedup']:.1f}x | {row.get('encode_s_per_record', 0):.2f} s |"
        )
    markdown = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
