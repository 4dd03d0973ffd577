"""Time to first token against context length: Prompt Cache, full prefill, and LangChain's HuggingFacePipeline.

Documents are the paragraphs of the SQuAD v1.1 article "Super_Bowl_50" (real text), stored with
``add_documents``. For each context length the prompt is one chat-formatted string: the system
turn, the first paragraphs up to that many tokens pasted as text, and a short question. All
series run on the same model object with that same prompt, in one run, median of ``--runs``
runs after a warm-up:

- ``full prefill``: ``engine.generate(prompt, use_cache=False)``
- ``cached (memory)``: module KV in memory (``kv_location``: device, or pinned CPU memory with ``--kv-location cpu``)
- ``cached (disk)``: the memory tier emptied before every run, so each run loads the modules from ``kv_dir``
- ``HuggingFacePipeline`` and ``PromptCacheLLM``: the same LCEL chain ``PromptTemplate | llm``
  with either LLM (``max_new_tokens=1``: the invoke time is the time to first token)

Writes JSON and a PNG plot (matplotlib).

    python benchmarks/ttft.py                                   # embedded SmolLM2-135M, CPU
    python benchmarks/ttft.py --device cuda --synthetic-7b --lengths 512 1024 2048 4096 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder

from pc_rag import PromptCache
from pc_rag.prompt.documents import DEFAULT_SYSTEM

QUESTION = "Which team won the game, and what was the final score?"
ROOT = Path(__file__).resolve().parents[1]


def paragraphs(data: Path) -> list[str]:
    article = json.loads((data / "squad_v1.1_dev_super_bowl_50.json").read_text())["data"][0]
    return [p["context"] for p in article["paragraphs"]]


def cached_paragraphs(engines: list[PromptCache], data: Path, longest: int) -> tuple[list[str], list[int]]:
    """As many paragraphs as the longest prompt needs, added to every engine's documents; their token counts."""
    engine, texts, budget = engines[0], [], longest + 64
    for text in paragraphs(data):
        budget -= len(engine.tokenize(text)) + 2
        if budget < 0:
            break
        texts.append(text)
    for each in engines:
        each.add_documents(texts)
    return texts, [len(engine.tokenize(t)) for t in texts]


def chat_prompt(engine: PromptCache, texts: list[str], sizes: list[int], target: int) -> tuple[str, int]:
    """The chat prompt: the system turn, the first paragraphs that fit ``target`` tokens (at least
    one) and the question; and how many paragraphs it holds."""
    count, total = 0, 0
    while count < len(sizes) and total + sizes[count] <= target:
        total += sizes[count]
        count += 1
    count = max(count, 1)
    user = "\n\n".join(texts[:count]) + f"\n\nQuestion: {QUESTION}"
    return engine.render_chat([{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": user}]), count


def synthetic_7b(device: str) -> tuple[Any, Any]:
    """A Llama-2-7B-shaped model with random bf16 weights (TTFT does not depend on weight values)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from pc_rag.model.loading import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192 + 512)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval(), tokenizer


def median_time(run: Callable[[], float], runs: int) -> float:
    run()  # warm-up
    return statistics.median(run() for _ in range(runs))


def timed(call: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - started

    return run


def chains(engine: PromptCache) -> dict[str, Any]:
    """``PromptTemplate | llm`` for both LLMs; skipped (with a note) when langchain-huggingface is missing."""
    from langchain_core.prompts import PromptTemplate

    from pc_rag.integrations.langchain import PromptCacheLLM

    template = PromptTemplate.from_template("{prompt}")
    built = {"PromptCacheLLM chain": template | PromptCacheLLM(engine=engine, max_new_tokens=1)}
    try:
        from langchain_huggingface import HuggingFacePipeline
        from transformers import pipeline
    except ImportError:
        print("langchain-huggingface is not installed (pip install langchain-huggingface): HuggingFacePipeline skipped")
        return built
    generator = pipeline("text-generation", model=engine.model, tokenizer=engine.tokenizer, max_new_tokens=1,
                         do_sample=False, return_full_text=False)
    built["HuggingFacePipeline chain"] = template | HuggingFacePipeline(pipeline=generator)
    return built


def plot(rows: list[dict[str, Any]], series: list[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    tokens = [r["prompt_tokens"] for r in rows]
    for name in series:
        ax.plot(tokens, [r["ttft_ms"][name] for r in rows], "o-", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--synthetic-7b", action="store_true", help="a randomly initialised Llama-7B-shaped model in bf16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--kv-location", choices=["device", "cpu"], nargs="+", default=["device"])
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 7680])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-chains", action="store_true", help="skip the LangChain series")
    parser.add_argument("--weights", choices=("float32", "float16", "int4"), default=None,
                        help="the engine's weights= (default: what from_pretrained gives: int4 for the embedded model on a CPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ttft.json")
    args = parser.parse_args()
    try:  # imported here: before_after.py runs this script against commits before pc_rag.weights.choice
        from pc_rag.weights.choice import chosen
    except ImportError:
        chosen = None
    embedded = args.model is None and not args.synthetic_7b
    try:
        weights = chosen(args.weights, from_gguf=embedded, device=args.device) if chosen is not None else args.weights
    except TypeError:  # a commit before from_gguf= (before_after.py)
        weights = chosen(args.weights, embedded=embedded, device=args.device)

    if args.synthetic_7b:
        model, tokenizer = synthetic_7b(args.device or "cuda")
    else:
        from pc_rag.model.loading import load_model

        model, tokenizer = load_model(args.model, device=args.device)
    kv_dir = Path(tempfile.mkdtemp(prefix="pc-rag-ttft-"))
    # one model object: the first engine puts its linear layers in `weights`, the others find them so
    options = {"weights": weights} if weights is not None else {}  # commits before weights= was an option
    engines = {where: PromptCache(model, tokenizer, kv_location=where, kv_dir=kv_dir / where, **options) for where in args.kv_location}
    engine = engines[args.kv_location[0]]
    texts, sizes = cached_paragraphs(list(engines.values()), args.data, max(args.lengths))
    llm_chains = {} if args.no_chains else chains(engine)

    rows = []
    for target in args.lengths:
        prompt, count = chat_prompt(engine, texts, sizes, target)
        plan = engine.plan(prompt)
        ttft: dict[str, float] = {}
        ttft["full prefill"] = median_time(timed(lambda: engine.generate(prompt, max_new_tokens=1, use_cache=False)), args.runs)
        for where, each in engines.items():
            label = "" if len(engines) == 1 else f", KV in {where} memory"
            ttft[f"cached (memory{label})"] = median_time(lambda e=each: e.generate(prompt, max_new_tokens=1).stats.ttft_s, args.runs)

        def from_disk() -> float:
            engine.store.clear_memory()
            return engine.generate(prompt, max_new_tokens=1).stats.ttft_s

        ttft["cached (disk)"] = median_time(from_disk, args.runs)
        for name, chain in llm_chains.items():
            ttft[name] = median_time(timed(lambda c=chain: c.invoke({"prompt": prompt})), args.runs)
        row = {
            "prompt_tokens": len(plan.input_ids),
            "documents": count,
            "cached_tokens": plan.cached_tokens,
            "computed_tokens": plan.computed_tokens,
            "ttft_ms": {k: 1000 * v for k, v in ttft.items()},
            "speedup_vs_full": {k: ttft["full prefill"] / v for k, v in ttft.items()},
        }
        if "HuggingFacePipeline chain" in ttft:
            row["chain_speedup"] = ttft["HuggingFacePipeline chain"] / ttft["PromptCacheLLM chain"]
        rows.append(row)
        print(f"{row['prompt_tokens']:5d} tokens: " + " | ".join(f"{k} {v * 1000:.0f} ms" for k, v in ttft.items()), flush=True)

    result = {
        **run_info(engine, "Llama-7B-shaped, random bf16 weights" if args.synthetic_7b else (args.model or "SmolLM2-135M-Instruct (embedded)")),
        "runs": args.runs,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(rows, list(rows[0]["ttft_ms"]), f"{result['model']} on {result['device']}", args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
