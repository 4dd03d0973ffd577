"""Answer quality of cached inference against full prefill, on real QA data, in one run.

HotpotQA (distractor): each record's 10 paragraphs are 10 document modules, imported in the
dataset's order; the question is the uncached text. Every variant (encoding mode x recovery) is
compared with full prefill of the very same tokens: EM and F1 against the gold answer (SQuAD
normalisation), first-token agreement and whole-answer agreement with full prefill (greedy),
the first token's KL divergence from full prefill (a continuous measure: agreement flips on near
ties), mean TTFT and the speedup over full prefill's mean TTFT.

SQuAD v1.1 "Super_Bowl_50": the 54 paragraphs are the corpus; each question retrieves its top-k
paragraphs with ``FaissModuleRetriever`` and imports them; recall@k, EM/F1 cached vs full prefill.

    python benchmarks/quality.py                       # everything, embedded SmolLM2-135M, CPU
    python benchmarks/quality.py --records 10 --squad-questions 20 --recovery 0:0 16:1

A recovery variant ``H:T`` recomputes the first H and the last T tokens of every moved document.

Writes ``benchmarks/results/quality.json`` and ``quality.md`` (the Markdown tables).
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import re
import statistics
import string
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from pc_rag import PromptCache, build_prompt
from pc_rag.engine import DEFAULT_RECOMPUTE, DEFAULT_RECOMPUTE_TAIL
from pc_rag.retrievers import FaissModuleRetriever

INSTRUCTION = "\nAnswer with only the answer, in a few words."
DECISIVE = 0.1  # full prefill's first token leads the runner-up by this much probability
ROOT = Path(__file__).resolve().parents[1]


# --- SQuAD metrics ---------------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, articles and extra whitespace (the official SQuAD script's rule)."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best(metric: Any, prediction: str, golds: list[str]) -> float:
    return max(float(metric(prediction, g)) for g in golds)


def exact(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


# --- runs --------------------------------------------------------------------------------------
def answer(engine: PromptCache, prompt: str, *, use_cache: bool, max_new_tokens: int) -> dict[str, Any]:
    result = engine.generate(prompt, max_new_tokens=max_new_tokens, use_cache=use_cache, stop=["\n"])
    # the first token's distribution, for the KL to full prefill (one more prefill, not timed)
    logprobs = engine.next_token_logits(prompt, use_cache=use_cache).float().log_softmax(-1)
    return {"text": result.text.strip(), "tokens": result.token_ids, "ttft_s": result.stats.ttft_s, "logprobs": logprobs}


def margin(logprobs: torch.Tensor) -> float:
    """How much probability the top token has over the runner-up."""
    first, second = logprobs.exp().topk(2).values
    return float(first - second)


def summarize(rows: list[dict[str, Any]], full: list[dict[str, Any]], golds: list[list[str]]) -> dict[str, Any]:
    n = len(rows)
    full_ttft = statistics.mean(r["ttft_s"] for r in full)
    ttft = statistics.mean(r["ttft_s"] for r in rows)
    kl = [float((f["logprobs"].exp() * (f["logprobs"] - r["logprobs"])).sum()) for r, f in zip(rows, full)]
    decisive = [i for i, f in enumerate(full) if margin(f["logprobs"]) >= DECISIVE]
    agree = [r["tokens"][:1] == f["tokens"][:1] for r, f in zip(rows, full)]
    return {
        "em": 100 * sum(best(exact, r["text"], g) for r, g in zip(rows, golds)) / n,
        "f1": 100 * sum(best(f1_score, r["text"], g) for r, g in zip(rows, golds)) / n,
        "first_token_agreement": 100 * sum(agree) / n,
        "decisive_questions": len(decisive),
        "decisive_agreement": 100 * sum(agree[i] for i in decisive) / max(1, len(decisive)),
        "first_token_kl": statistics.mean(kl),
        "answer_agreement": 100 * sum(r["tokens"] == f["tokens"] for r, f in zip(rows, full)) / n,
        "mean_ttft_ms": 1000 * ttft,
        "speedup": full_ttft / ttft,
    }


def hotpotqa(model: Any, tokenizer: Any, data: Path, records: int, recovery: list[tuple[int, int]], encodings: list[str], max_new: int) -> dict:
    rows = [json.loads(line) for line in (data / "hotpotqa_dev_distractor_53.jsonl").read_text().splitlines()[:records]]
    golds = [[r["answer"]] for r in rows]
    engines = {encoding: PromptCache(model, tokenizer, encoding=encoding) for encoding in encodings}
    prompts: dict[str, list[str]] = {encoding: [] for encoding in encodings}
    for encoding, engine in engines.items():
        for record in tqdm(rows, desc=f"encoding HotpotQA ({encoding})", unit="record"):
            texts = [f"{title}: {''.join(sentences).strip()}" for title, sentences in record["context"]]
            names = engine.add_documents(texts, progress=False)
            prompts[encoding].append(build_prompt(record["question"] + INSTRUCTION, names))
    first = engines[encodings[0]]
    full = [answer(first, p, use_cache=False, max_new_tokens=max_new) for p in tqdm(prompts[encodings[0]], desc="full prefill")]
    lengths = [len(first.plan(p).input_ids) for p in prompts[encodings[0]]]
    variants: dict[str, Any] = {"full prefill": summarize(full, full, golds)}
    outputs: dict[str, list[str]] = {"full prefill": [r["text"] for r in full]}
    for encoding, engine in engines.items():
        for head, tail in recovery:
            engine.recompute, engine.recompute_tail = head, tail
            name = f"{encoding}, recompute={head}, tail={tail}"
            got = [answer(engine, p, use_cache=True, max_new_tokens=max_new) for p in tqdm(prompts[encoding], desc=name)]
            variants[name] = summarize(got, full, golds)
            outputs[name] = [r["text"] for r in got]
    return {"records": len(rows), "mean_prompt_tokens": statistics.mean(lengths), "variants": variants, "outputs": outputs,
            "gold": [g[0] for g in golds]}


def squad(model: Any, tokenizer: Any, data: Path, questions: int, k: int, max_new: int) -> dict:
    article = json.loads((data / "squad_v1.1_dev_super_bowl_50.json").read_text())["data"]
    paragraphs = [p for a in article for p in a["paragraphs"]]
    pairs = [(i, qa) for i, p in enumerate(paragraphs) for qa in p["qas"]]
    step = max(1, len(pairs) // questions)
    pairs = pairs[::step][:questions]  # spread over the article, deterministic
    engine = PromptCache(model, tokenizer)
    retriever = FaissModuleRetriever(engine=engine)
    names = retriever.add([p["context"] for p in paragraphs])
    hits_at_k, full, cached, golds = 0, [], [], []
    for index, qa in tqdm(pairs, desc=f"SQuAD top-{k}"):
        hits = retriever.search(qa["question"], k=k)
        hits_at_k += names[index] in [h.module for h in hits]
        prompt = build_prompt(qa["question"] + INSTRUCTION, [h.module for h in hits])
        full.append(answer(engine, prompt, use_cache=False, max_new_tokens=max_new))
        cached.append(answer(engine, prompt, use_cache=True, max_new_tokens=max_new))
        golds.append([a["text"] for a in qa["answers"]])
    return {
        "questions": len(pairs),
        "k": k,
        f"recall@{k}": 100 * hits_at_k / len(pairs),
        "variants": {"full prefill": summarize(full, full, golds), f"cached, recompute={engine.recompute}, tail={engine.recompute_tail}": summarize(cached, full, golds)},
    }


def markdown(report: dict[str, Any]) -> str:
    lines = []
    for title, part in (("HotpotQA", report.get("hotpotqa")), ("SQuAD", report.get("squad"))):
        if not part:
            continue
        if "k" in part:
            recall = part[f"recall@{part['k']}"]
            extra = f", top-{part['k']} retrieval, recall@{part['k']} = {recall:.1f}%"
        else:
            extra = f", 10 paragraphs, {part['mean_prompt_tokens']:.0f} prompt tokens on average"
        count = part.get("records", part.get("questions"))
        lines += [f"**{title}** ({count} questions{extra})", "",
                  "| variant | EM | F1 | first token = full | (decisive) | first-token KL | answer = full | mean TTFT | speedup |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, v in part["variants"].items():
            lines.append(f"| {name} | {v['em']:.1f} | {v['f1']:.1f} | {v['first_token_agreement']:.1f}% | "
                         f"{v['decisive_agreement']:.1f}% | {v['first_token_kl']:.3f} | "
                         f"{v['answer_agreement']:.1f}% | {v['mean_ttft_ms']:.0f} ms | {v['speedup']:.1f}x |")
        decisive = next(iter(part["variants"].values()))["decisive_questions"]
        lines += ["", f"(decisive): agreement on the {decisive} questions where full prefill's first token leads "
                      f"the runner-up by >= {DECISIVE} probability; first-token KL: mean KL(full || cached) in nats."]
        lines.append("")
    return "\n".join(lines)


def recovery_spec(text: str) -> tuple[int, int]:
    """``H:T`` (recompute H head and T tail tokens per moved document), or ``H`` for ``H:0``."""
    head, _, tail = text.partition(":")
    try:
        return int(head), int(tail or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEAD:TAIL token counts such as 4:1, got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=None, help="hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--records", type=int, default=53)
    parser.add_argument("--recovery", type=recovery_spec, nargs="+", metavar="HEAD:TAIL",
                        default=[(0, 0), (4, 0), (0, 1), (2, 1), (DEFAULT_RECOMPUTE, DEFAULT_RECOMPUTE_TAIL), (8, 8)])
    parser.add_argument("--encodings", nargs="+", default=["shared_prefix", "isolated"])
    parser.add_argument("--squad-questions", type=int, default=100)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quality.json")
    args = parser.parse_args()

    probe = PromptCache.from_pretrained(args.model, device=args.device, recompute=0)
    model, tokenizer = probe.model, probe.tokenizer
    started = time.time()
    report: dict[str, Any] = {
        "model": str(getattr(model.config, "_name_or_path", "")),
        "device": str(model.device),
        "dtype": str(model.dtype),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "greedy_max_new_tokens": args.max_new_tokens,
    }
    if args.records:
        report["hotpotqa"] = hotpotqa(model, tokenizer, args.data, args.records, list(dict.fromkeys(args.recovery)), args.encodings, args.max_new_tokens)
    if args.squad_questions:
        report["squad"] = squad(model, tokenizer, args.data, args.squad_questions, args.k, args.max_new_tokens)
    report["wall_s"] = time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    table = markdown(report)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
