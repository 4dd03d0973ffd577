"""Follow a prompt from ``PromptCache.generate`` through the package: the ``pc_rag`` files its calls
enter, in order, on the caller's thread and the scheduler's (a change of file is a stop), and how
often each file is entered. docs/architecture.md walks the same path.

    python benchmarks/follow_prompt.py

A tiny random Llama over the embedded tokenizer: the path, not the numbers, is what it shows.
"""
import sys
import threading
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pc_rag import PromptCache, build_prompt
from pc_rag.model.loading import default_model_dir

tok = AutoTokenizer.from_pretrained(default_model_dir())
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)).eval()
ON = [False]
threading.settrace(lambda *a: tracer(*a) if ON[0] else None)
engine = PromptCache(model, tok)
names = engine.add_documents(["The harbour handles ships.", "The old town lies east."], progress=False)
prompt = build_prompt("Where is the town?", names)
engine.generate(prompt, max_new_tokens=1)  # warm
root = str(Path(__file__).resolve().parents[1] / "pc_rag")
stops = []
def tracer(frame, event, arg):
    if event == "call" and ON[0]:
        f = frame.f_code.co_filename
        if f.startswith(root):
            rel = f[len(root) + 1:]
            if not stops or stops[-1] != rel:
                stops.append(rel)
    return None
ON[0] = True
sys.settrace(tracer)
engine.generate(prompt, max_new_tokens=1)
sys.settrace(None)
ON[0] = False
print(len(stops), "stops in", len(set(stops)), "files")
print(" -> ".join(stops))
print(Counter(stops).most_common(8))
