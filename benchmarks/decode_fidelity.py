"""What the decode step's precision does to answers: the embedded model's weights as float32 (its
GGUF's blocks dequantized), ``"int4"`` (the same blocks on pc-rag's kernels; the C decode step's 4-bit
products on inputs rounded to 16 bits a block where the CPU has AVX512-VNNI), ``"int4"`` with float32
inputs in decode too (``int4 float inputs``) and ``"int4-a8"`` (decode steps' inputs in 8 bits a block,
as llama.cpp computes), each engine over its own copy of the model, on the same held-out prompts
(``build_prompt(question, passages)``, the documents cached), greedy, ``--tokens`` new tokens,
end-of-sequence banned.

Per precision against float32 (and against int4's other inputs): the mean KL of each decode step's next-token
distribution over the steps both answers share (up to the first token where they part), the share of
whole answers equal, and the mean number of tokens before they part. The first token is prefill's
(unchanged by a8) and is counted apart.

    python benchmarks/decode_fidelity.py                       # hotpotqa_more:20, 32 tokens, ~4 min
    python benchmarks/decode_fidelity.py --sets hotpotqa_more:40 nq:20 --tokens 64
    python benchmarks/decode_fidelity.py --model my-model.Q4_K_M.gguf --out results/decode_fidelity_mine.json

Writes benchmarks/results/decode_fidelity.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from quality import INSTRUCTION, load  # noqa: E402

from pc_rag import PromptCache, build_prompt  # noqa: E402

PRECISIONS = ("float32", "int4", "int4 float inputs", "int4-a8")
PAIRS = (("int4", "float32"), ("int4 float inputs", "float32"), ("int4", "int4 float inputs"), ("int4-a8", "float32"),
         ("int4-a8", "int4"))


def engine_for(precision: str, model: Path | None = None) -> PromptCache:
    """The embedded model (or the GGUF file ``model``) at ``precision`` (``int4 float inputs``: weights="int4", its C step on
    float32 inputs). On a GGUF file, "int4" holds the file's own blocks: its layers of types pc-rag's kernels do not hold
    (Q6_K, Q5_K) are the only ones whose values differ from float32's, so ``int4 float inputs vs float32`` is what they cost."""
    engine = PromptCache.from_pretrained(model, weights=precision.split()[0])
    if precision == "int4 float inputs" and engine.forward.written_step is not None and engine.forward.written_step.fused is not None:
        engine.forward.written_step.fused.activation_bits = 32
    return engine


def answer(engine: PromptCache, question: str, passages: list[str], tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy token ids and each step's next-token log-distribution ``[tokens, vocab]``."""
    names = engine.add_documents(passages, progress=False)
    result = engine.generate(build_prompt(question + INSTRUCTION, names), max_new_tokens=tokens, output_logits=True)
    engine.store.delete(list(engine.store._memory))  # this record's modules are not read again
    return result.token_ids, torch.stack([step.float().log_softmax(-1) for step in result.logits])


def compared(a: tuple[list[int], torch.Tensor], b: tuple[list[int], torch.Tensor]) -> dict[str, Any]:
    """KL(b || a) at the first token and over the decode steps the two answers share."""
    (tokens_a, logits_a), (tokens_b, logits_b) = a, b
    shared = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), len(tokens_a))
    kl = (logits_b.exp() * (logits_b - logits_a)).sum(-1)  # step i: the distribution of token i
    return {"first_kl": float(kl[0]), "decode_kl": float(kl[1:shared + 1].mean()) if shared >= 1 else float("nan"),
            "equal": tokens_a == tokens_b, "shared_tokens": shared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", default=["hotpotqa_more:20"], help="SET[:FIRST] (benchmarks/quality.py's sets)")
    parser.add_argument("--skip", type=int, default=40, help="records skipped first (hotpotqa_more's first 40 tuned recovery)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded model)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_fidelity.json")
    args = parser.parse_args()
    engines = {precision: engine_for(precision, args.model) for precision in PRECISIONS}
    for engine in engines.values():
        engine.stop_token_ids.clear()  # every answer --tokens long
    fused = engines["int4"].forward.written_step.fused if engines["int4"].forward.written_step is not None else None
    report: dict[str, Any] = {"tokens": args.tokens, "int4 decode input bits": fused.activation_bits if fused else 32,
                              "run": run_info(engines["int4-a8"], args.model.name if args.model else "SmolLM2-135M-Instruct (embedded)")}
    for spec in args.sets:
        name, _, count = spec.partition(":")
        rows = []
        for record in tqdm(load(name, ROOT / "benchmarks" / "data", int(count) if count else None, args.skip), desc=name):
            answers = {precision: answer(engine, record.question, record.passages, args.tokens) for precision, engine in engines.items()}
            rows.append({f"{b} vs {a}": compared(answers[a], answers[b]) for b, a in PAIRS})
        summary = {}
        for pair in rows[0]:
            values = [row[pair] for row in rows]
            decode = [v["decode_kl"] for v in values if v["decode_kl"] == v["decode_kl"]]
            summary[pair] = {"first_kl": statistics.mean(v["first_kl"] for v in values),
                             "decode_kl": statistics.mean(decode) if decode else None,
                             "answers_equal": 100 * statistics.mean(v["equal"] for v in values),
                             "tokens_before_parting": statistics.mean(v["shared_tokens"] for v in values)}
        report[spec] = {"questions": len(rows), **summary}
        print(spec, json.dumps(summary, indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
