"""Decode ms/token: pc-rag's decode loop (eager and ``compile=True``) against transformers' own
``model.generate`` on the same prompt tokens, in one run, median of ``--runs`` after a warm-up.

The prompt is the first SQuAD "Super_Bowl_50" paragraphs (about ``--length`` tokens) stored as
documents, and a question; every call generates exactly ``--new-tokens`` tokens, greedy
(end-of-sequence ignored). Decode ms/token is (whole call - first token) / (tokens - 1); for
transformers, (generate(n) - generate(1)) / (n - 1).

    python benchmarks/decode.py                  # embedded SmolLM2-135M, CPU
    python benchmarks/decode.py --no-compile     # skip torch.compile (its first call compiles: ~2 min here)
    python benchmarks/decode.py --no-compile --int4 --out benchmarks/results/decode_int4.json   # weights="int4" too,
                                                 # and with its decode thread count held at 1 and at all
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder
from ttft import median_time, timed  # the same timing as the TTFT curve

from pc_rag import PromptCache
from pc_rag.forward.threads import DecodeThreads
from pc_rag.model.loading import load_model
from pc_rag.prompt.documents import build_prompt

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--int4", action="store_true", help="also weights=\"int4\" (a second copy of the model, its linear layers in 4 bits)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode.json")
    args = parser.parse_args()

    model, tokenizer = load_model(None)
    article = json.loads((args.data / "squad_v1.1_dev_super_bowl_50.json").read_text())["data"][0]
    docs, total = [], 0
    for paragraph in (p["context"] for p in article["paragraphs"]):
        if total >= args.length:
            break
        docs.append(paragraph)
        total += len(tokenizer(paragraph, add_special_tokens=False)["input_ids"])
    ids = [f"p{i}" for i in range(len(docs))]
    prompt = build_prompt("Which team won the game, and what was the final score?", ids)
    n = args.new_tokens
    engines = {"pc-rag": PromptCache(model, tokenizer)}
    if not args.no_compile:
        engines["pc-rag compile=True"] = PromptCache(model, tokenizer, compile=True)
    if args.int4:
        engines["pc-rag weights=int4"] = PromptCache(load_model(None)[0], tokenizer, weights="int4")
        for count in sorted({1, torch.get_num_threads()}):  # the decode thread count held fixed, against the measured choice
            engine = engines[f"pc-rag weights=int4, decode threads={count}"] = PromptCache(load_model(None)[0], tokenizer, weights="int4")
            engine.forward.decode_threads = DecodeThreads(engine.device, fixed=count)
    result: dict[str, Any] = {**run_info(engines["pc-rag"], "SmolLM2-135M-Instruct (embedded)"), "new_tokens": n,
                              "decode_ms_per_token": {}}
    for name, engine in engines.items():
        engine.add_documents(docs, ids=ids, progress=False)
        engine.stop_token_ids = set()

        def decode_ms(engine: PromptCache = engine) -> float:
            stats = engine.generate(prompt, max_new_tokens=n).stats
            return 1000 * (stats.total_s - stats.ttft_s) / (stats.generated_tokens - 1)

        result["decode_ms_per_token"][name] = median_time(decode_ms, args.runs)
        result.setdefault("decode_threads_chosen", {})[name] = engine.forward.decode_threads.chosen
        result["prompt_tokens"] = len(engine.plan(prompt).input_ids)
        print(name, round(result["decode_ms_per_token"][name], 2), "ms/token", flush=True)
    if args.int4:  # the 4-bit path against float32 on the same prompt: how far the weights moved the answer
        full, low = (engines[k].next_token_logits(prompt).log_softmax(-1) for k in ("pc-rag", "pc-rag weights=int4"))
        result["int4_first_token_kl_vs_float32"] = torch.nn.functional.kl_div(low, full, log_target=True, reduction="sum").item()
        result["int4_first_token_equal"] = bool(full.argmax() == low.argmax())
        print("int4 vs float32: first-token KL", round(result["int4_first_token_kl_vs_float32"], 4), flush=True)
    input_ids = torch.tensor([engines["pc-rag"].plan(prompt).input_ids])

    def generate(new: int) -> Any:
        with torch.inference_mode():
            return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0)

    first = median_time(timed(lambda: generate(1)), args.runs)
    whole = median_time(timed(lambda: generate(n)), args.runs)
    result["decode_ms_per_token"]["transformers generate"] = 1000 * (whole - first) / (n - 1)
    print("transformers generate", round(result["decode_ms_per_token"]["transformers generate"], 2), "ms/token")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
