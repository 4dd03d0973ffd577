"""A process that serves a corpus about 4x larger than its memory budget and reports its memory.

Run by tests/test_memory_budget.py: ``python memory_worker.py TOKENIZER_DIR BUDGET_BYTES``.
The model is a tiny Llama shaped for a large KV per token (8 layers x 8 KV heads x 64 dims:
32 KiB per token in fp32) and little compute, so the KV, not the weights, dominates memory.
Prints one JSON line: the KV bytes of the corpus, the resident-set high-water mark after warm-up
(``base``) and at the end (``peak``), and the store's counters.
"""

from __future__ import annotations

import gc
import json
import random
import resource
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from pc_rag import PromptCache, build_prompt

DOCUMENTS = 100
WORDS = "river bridge lantern harbour signal orchard meadow archive furnace glacier turbine ledger".split()


def high_water_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    tokenizer_dir, budget = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    engine = PromptCache(model, tokenizer, memory_budget=budget)  # evicted modules spill to a private folder
    rng = random.Random(0)
    texts = [f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(190)) for i in range(DOCUMENTS)]

    # warm-up: the allocator, the thread pools and the buffers a request needs
    warm = engine.add_documents(texts[:2], progress=False)
    engine.generate(build_prompt("warm up?", warm), max_new_tokens=4)
    gc.collect()
    base = high_water_bytes()

    names = warm + engine.add_documents(texts[2:], progress=False)
    for q in range(40):  # every document is imported by some query; most come back from disk
        picked = [names[(q * 5 + j) % DOCUMENTS] for j in range(4)]
        engine.generate(build_prompt(f"Which words appear in document {q}?", picked), max_new_tokens=4)
    layout = engine.schemas["docs"].layout
    corpus = sum(len(layout.modules[n].token_ids) for n in names) * engine._kv_bytes_per_token
    print(json.dumps({"corpus_bytes": corpus, "base": base, "peak": high_water_bytes(), "memory_bytes": engine.store.memory_bytes,
                      "disk_loads": engine.store.disk_loads, "encoded": engine.forward.encoded}), flush=True)


if __name__ == "__main__":
    main()
