"""KV buffers in float32 against 16 bits (``PromptCache(kv_dtype=)``): decode speed of a batch and fidelity, in one run.

Engines over one model object (the embedded SmolLM2-135M at its defaults), one per ``--dtypes``. The prompts are
``throughput.py``'s: the first SQuAD "Super_Bowl_50" paragraphs up to ``--shared`` tokens as documents, one
article question each. Speed, alternating engine by engine each round (medians of ``--rounds``), decode tokens/s of

- ``one request``: ``generate`` alone;
- ``shared batch``: ``generate_batch`` of ``--batch`` prompts (the documents' KV read in place once a step for all rows);
- ``private batch``: the same with ``share_modules=False`` (each row reads its own copy: private documents' cost).

Fidelity against the float32 engine, on ``--questions`` questions (cached prompts, greedy): the first token's
KL(float32 || 16-bit) in nats, the first token the same, and the whole ``--new-tokens`` answer the same.

    python benchmarks/kv_dtype.py --shared 1024 --batch 8 --new-tokens 64 --rounds 3 --questions 24
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder
from throughput import documents_up_to, measure, squad

from pc_rag import PromptCache, build_prompt
from pc_rag.model.loading import load_model
from pc_rag.weights.choice import chosen

ROOT = Path(__file__).resolve().parents[1]


def fidelity(reference: PromptCache, engine: PromptCache, prompts: list[str], new_tokens: int) -> dict[str, float]:
    """First-token KL, first-token and whole-answer agreement of ``engine`` against ``reference``."""
    kls, firsts, wholes = [], [], []
    for prompt in prompts:
        wide, narrow = reference.next_token_logits(prompt).float(), engine.next_token_logits(prompt).float()
        p, q = wide.log_softmax(-1), narrow.log_softmax(-1)
        kls.append(float((p.exp() * (p - q)).sum()))
        firsts.append(int(wide.argmax()) == int(narrow.argmax()))
        wholes.append(reference.generate(prompt, max_new_tokens=new_tokens).token_ids == engine.generate(prompt, max_new_tokens=new_tokens).token_ids)
    return {"first_token_kl": statistics.mean(kls), "max_first_token_kl": max(kls), "first_token_same": statistics.mean(firsts),
            "answer_same": statistics.mean(wholes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--shared", type=int, default=1024, help="document tokens every prompt imports")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_dtype.json")
    args = parser.parse_args()
    model, tokenizer = load_model(None)
    weights = chosen(None, from_gguf=True, device=None)  # what from_pretrained gives the embedded model (int4 on a CPU)
    engines = {dtype: PromptCache(model, tokenizer, weights=weights, kv_dtype=dtype, kv_dir=tempfile.mkdtemp(prefix=f"pc-rag-{dtype}-"))
               for dtype in args.dtypes}
    contexts, questions = squad(args.data)
    first = next(iter(engines.values()))
    texts = documents_up_to(first, contexts, args.shared)
    ids = {dtype: engine.add_documents(texts, progress=False) for dtype, engine in engines.items()}
    prompts = {dtype: [build_prompt(q, ids[dtype]) for q in questions[:max(args.batch, args.questions)]] for dtype in engines}
    for engine in engines.values():
        engine.stop_token_ids = set()  # every row decodes --new-tokens: the same work on every side
        engine.generate_batch(prompts[args.dtypes[0]][:args.batch], max_new_tokens=4)  # warm-up
    modes = {"one request": ("sequential", 1), "shared batch": ("shared batch", args.batch), "private batch": ("naive batch", args.batch)}
    speed: dict[str, dict[str, list[float]]] = {mode: {dtype: [] for dtype in engines} for mode in modes}
    for _ in range(args.rounds):
        for mode, (how, rows) in modes.items():
            for dtype, engine in engines.items():
                speed[mode][dtype].append(measure(engine, prompts[dtype][:rows], how, args.new_tokens)["decode_tokens_per_s"])
    table = {mode: {dtype: statistics.median(runs) for dtype, runs in by.items()} for mode, by in speed.items()}
    for mode, by in table.items():
        print(f"{mode:14s} " + "  ".join(f"{dtype} {rate:6.1f} tok/s ({rate / by[args.dtypes[0]]:.2f}x)" for dtype, rate in by.items()), flush=True)
    for engine in engines.values():
        engine.stop_token_ids = set(engine.spec.stop_token_ids)
    reference = engines[args.dtypes[0]]
    quality = {dtype: fidelity(reference, engine, prompts[dtype][:args.questions], args.new_tokens)
               for dtype, engine in engines.items() if engine is not reference}
    for dtype, row in quality.items():
        print(f"{dtype}: first-token KL {row['first_token_kl']:.5f} (max {row['max_first_token_kl']:.5f}), first token same "
              f"{row['first_token_same']:.0%}, whole answer same {row['answer_same']:.0%}", flush=True)
    prompt_tokens = len(first.plan(prompts[args.dtypes[0]][0]).input_ids)
    args.out.write_text(json.dumps({"run": run_info(first, "SmolLM2-135M-Instruct (embedded)"), "prompt_tokens": prompt_tokens,
                                    "batch": args.batch, "new_tokens": args.new_tokens, "rounds": args.rounds,
                                    "decode_tokens_per_s": table, "fidelity_vs_float32": quality,
                                    "threads": torch.get_num_threads()}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
