"""Registration cost: ``add_documents`` of many short texts, with and without a memory budget.

With ``memory_budget`` and no ``kv_dir`` the engine keeps a private spill folder for modules
evicted from memory. Writing (and fsyncing) every module there when it is encoded made
registration several times slower than encoding itself; modules go there on eviction only.
The model is a tiny randomly initialised Llama (2 layers, the embedded tokenizer), so that the
bookkeeping, not the forward passes, is what is measured.

    python benchmarks/registration.py [--documents 300] [--runs 5] [--out benchmarks/results/registration.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from pc_rag import PromptCache
from pc_rag.model.loading import default_model_dir

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "registration.json"))
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    texts = [f"Note {i}: the tide table for harbour {i % 17} lists high water at {i % 12}:{i % 60:02d}." for i in range(args.documents)]
    settings = {"no budget": {}, "memory_budget, no kv_dir (spill folder)": {"memory_budget": 1 << 30}}
    timings: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.runs):
        for name, kwargs in settings.items():
            engine = PromptCache(model, tokenizer, **kwargs)
            t0 = time.perf_counter()
            engine.add_documents(texts, progress=False)
            timings[name].append(time.perf_counter() - t0)
    result = {"documents": args.documents, "runs": args.runs,
              "add_documents_ms_median": {name: statistics.median(v) * 1000 for name, v in timings.items()}}
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
