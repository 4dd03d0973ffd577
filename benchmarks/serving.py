"""Many callers at once: the scheduler against one-at-a-time serving and an explicit batch.

Part ``concurrency`` (the embedded SmolLM2-135M): HotpotQA dev-distractor records (``--skip``
records in, never used for tuning), each a RAG prompt of ``--passages`` passages registered as
documents, answered with ``--new-tokens`` tokens (stop tokens off, so every mode decodes the same
number of tokens). For each N in ``--callers``, the same N prompts are served

- ``sequential``: ``engine.generate`` one after another (each caller waits for those before it);
- ``generate_batch``: one explicit ``engine.generate_batch`` of the N prompts;
- ``threads``: N threads calling ``engine.generate`` at once (the scheduler batches them);
- ``langchain ainvoke``: N ``PromptCacheLLM.ainvoke`` calls under ``asyncio.gather``;

and wall time, tokens/s, mean and p95 TTFT and latency are reported, median of ``--repeats``
runs (each mode's order rotates between runs). With ``--overlap`` the N prompts import the same
passages (different questions); without it, each prompt its own.

Part ``overhead`` (a tiny random Llama, whose forward pass costs almost nothing): one request's
decode steps through the scheduler against the bare decode loop (``generate.decode``) over the
same prefilled rows: the time the scheduler adds per step.

Part ``compiled`` (the same tiny model): ``max(--callers)`` callers arriving one after another
while the others decode, prompts and budgets of growing length, every other one over documents,
served eagerly, with ``compile=True`` as they come, and with ``compile=True`` after
``engine.warm_up()``: how often the step compiles while serving, the first caller's latency, the
step shapes it served, the steps run compiled, the requests failed, and whether every caller's
tokens equal eager serving's. Each mode compiles with torch's on-disk caches empty; the warm-up
is timed again with the cache it filled (a restarted server).

Part ``warm-up`` (the embedded SmolLM2-135M, ``compile=True``): how long ``engine.warm_up()``
takes with torch's on-disk caches empty, then ``max(--callers)`` concurrent RAG callers
(``--passages`` passages of HotpotQA records from ``--skip``) and a ``generate_batch`` of three:
the compilations while serving them; then a second engine's warm-up with the caches kept.

Part ``fused``: one step that admits a newcomer, its prefill and the running rows' decode step
as two passes against one packed pass (``fuse_prefill``), for running batches of ``--callers`` rows.

Part ``linear``: decode-sized linear layers (``small_batch_linear``): ``F.linear`` against
``W @ x^T`` over the model's weights for ``--callers`` rows, and a decode step of that many rows
with the switch off and on.

Part ``arrivals``: requests arriving as a Poisson process at ``--rates`` (with ``--overlap``,
every request imports the same passages, its own question: the papers' setting); the sustainable rate
(p95 latency within ``--p95-bound``) of the scheduler (and of the same scheduler with each
newcomer's prefill in passes of its own, ``fuse_prefill=False``), of one-at-a-time serving and of
transformers' own continuous batching (``ContinuousBatchingManager``, paged attention over the
full prompts' token ids) on the same model and prompts. Each rate runs ``--repeats`` Poisson draws
that serve every mode in turn (the order rotating), and reports the medians.

Part ``reads``: what the scheduler's decode steps read over one Poisson draw per rate in
``--rates``: the cache entries every step attends to (each row reads the batch's attended width)
against the entries its live rows hold, split into finished rows that still sit in the batch,
live rows' padding up to the write column (shorter prompts, skipped columns) and entries past it;
and what the steps read with each row within its own extent (a CPU step: ``pc_rag.forward.row_extents``).

Part ``extents``: a decode step of ``--callers`` rows, each row attending within its own extent
against one attention call over the batch's whole width, for rows of even and of spread lengths.

    python benchmarks/serving.py concurrency --callers 1 4 8 --repeats 3
    python benchmarks/serving.py arrivals
    python benchmarks/serving.py overhead
    python benchmarks/serving.py compiled
    python benchmarks/serving.py warm-up --callers 6 --passages 4
    python benchmarks/serving.py fused --set musique --skip 40 --passages 16 --callers 1 4 8
    python benchmarks/serving.py linear --set musique --skip 40 --passages 16 --callers 1 2 3 4 8 16 --overlap
    python benchmarks/serving.py reads --set musique --skip 40 --passages 16 --rates 1.0
    python benchmarks/serving.py extents --set musique --skip 40 --passages 16 --callers 2 3 4 8 16 --steps 20
    python benchmarks/serving.py plot
Writes ``benchmarks/results/serving_<part>.json`` and prints a markdown table; part ``plot`` draws
the results written (``PLOTTED``) as ``benchmarks/results/serving.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from run_info import run_info  # benchmarks/run_info.py: scripts run from this folder

from pc_rag import PromptCache, build_prompt

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"


UNFUSED = "scheduler, prefill between steps"
WHOLE_WIDTH = "scheduler, rows read the batch's width"
SETS = {"hotpotqa": "hotpotqa_dev_distractor_more.jsonl", "musique": "musique_ans_dev_20docs.jsonl"}


def records(data: Path, skip: int, count: int, passages: int, dataset: str = "hotpotqa", *, overlap: bool = False
            ) -> list[tuple[str, list[str]]]:
    """(question, passages) of records ``skip .. skip + count`` of ``dataset`` (HotpotQA dev-distractor:
    10 passages a record; MuSiQue: 20). A prompt of more passages than its record holds takes
    the rest, as distractors, from the records after it (for long prompts; answers unchanged).
    ``overlap``: every question with the first record's passages (the papers' setting: a shared
    document set, each request its own question)."""
    lines = (data / SETS[dataset]).read_text().splitlines()
    out = []
    for index in range(skip, skip + count):
        record = json.loads(lines[index])
        texts: list[str] = []
        for line in lines[index:] + lines[:index]:
            texts += [f"{p['title']}: {p['text']}" for p in json.loads(line)["passages"]]
            if len(texts) >= passages:
                break
        out.append((record["question"], texts[:passages]))
    return [(question, out[0][1]) for question, _ in out] if overlap else out


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}


def p95(values: list[float]) -> float:
    """The 95th percentile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    """Arrival times (s from the start) of ``count`` requests arriving as a Poisson process at ``rate``/s."""
    clock = random.Random(seed)
    at, offsets = 0.0, []
    for _ in range(count):
        at += clock.expovariate(rate)
        offsets.append(at)
    return offsets


def on_schedule(offsets: list[float], answer: Any) -> list[float]:
    """``answer(index)`` for request ``index`` on a thread of its own, started ``offsets[index]``
    seconds from now; each request's latency, arrival to answer."""
    start = time.perf_counter()

    def call(index: int) -> float:
        time.sleep(max(0.0, start + offsets[index] - time.perf_counter()))  # arrive on schedule
        arrived = time.perf_counter()
        answer(index)
        return time.perf_counter() - arrived

    with ThreadPoolExecutor(len(offsets)) as workers:
        return list(workers.map(call, range(len(offsets))))


def rag_engine(args: argparse.Namespace) -> tuple[PromptCache, list[str]]:
    """The embedded model's engine (stop tokens off) and ``--requests`` prompts over their
    registered passages, warmed up: what the arrivals and reads parts serve."""
    engine = PromptCache.from_pretrained()
    engine.stop_token_ids.clear()
    pool = records(args.data, args.skip, args.requests, args.passages, args.set, overlap=args.overlap)
    prompts = [build_prompt(q, engine.add_documents(passages, progress=False)) for q, passages in pool]
    serve(engine, "sequential", prompts[:2], 4)  # warm-up
    return engine, prompts


def summary(calls: list[dict[str, float]], wall: float) -> dict[str, float]:
    ttft = [c["ttft_s"] for c in calls]
    latency = [c["latency_s"] for c in calls]
    # computed tokens per call: every mode must do the same prefill work (the same prompts, read alike)
    return {"wall_s": wall, "tokens_per_s": sum(c["tokens"] for c in calls) / wall, "computed_mean": statistics.mean(c["computed"] for c in calls),
            "ttft_mean_s": statistics.mean(ttft), "ttft_p95_s": p95(ttft),
            "latency_mean_s": statistics.mean(latency), "latency_p95_s": p95(latency)}


def serve(engine: PromptCache, mode: str, prompts: list[str], new_tokens: int) -> dict[str, float]:
    """Serve ``prompts`` in ``mode``; per-call TTFT and latency counted from when all were handed in."""
    calls: list[dict[str, float]] = []
    start = time.perf_counter()
    if mode == "sequential":
        for prompt in prompts:
            result = engine.generate(prompt, max_new_tokens=new_tokens)
            calls.append({"ttft_s": result.stats.ttft_s + (time.perf_counter() - start - result.stats.total_s),
                          "latency_s": time.perf_counter() - start, "tokens": len(result.token_ids),
                          "computed": result.stats.computed_tokens})
    elif mode == "generate_batch":
        results = engine.generate_batch(prompts, max_new_tokens=new_tokens)
        done = time.perf_counter() - start
        calls = [{"ttft_s": r.stats.ttft_s, "latency_s": done, "tokens": len(r.token_ids), "computed": r.stats.computed_tokens}
                 for r in results]
    elif mode == "threads":
        gate = threading.Barrier(len(prompts) + 1)

        def call(prompt: str) -> dict[str, float]:
            gate.wait()
            result = engine.generate(prompt, max_new_tokens=new_tokens)
            return {"ttft_s": result.stats.ttft_s, "latency_s": time.perf_counter() - start, "tokens": len(result.token_ids),
                    "computed": result.stats.computed_tokens}

        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(call, p) for p in prompts]
            start = time.perf_counter()
            gate.wait()
            calls = [f.result() for f in futures]
    elif mode == "langchain ainvoke":
        from pc_rag.integrations.langchain import PromptCacheLLM

        llm = PromptCacheLLM(engine=engine, max_new_tokens=new_tokens, pml=True)  # the prompts are PML: read as markup, as the other modes do

        async def call(prompt: str) -> dict[str, float]:
            result = await llm.agenerate([prompt])
            info = result.generations[0][0].generation_info or {}
            return {"ttft_s": info.get("ttft_s", 0.0), "latency_s": time.perf_counter() - start,
                    "tokens": info.get("generated_tokens", new_tokens), "computed": info["computed_tokens"]}

        async def gather() -> list[dict[str, float]]:
            return list(await asyncio.gather(*(call(p) for p in prompts)))

        start = time.perf_counter()
        calls = asyncio.run(gather())
    else:
        raise ValueError(mode)
    return summary(calls, time.perf_counter() - start)


def concurrency(args: argparse.Namespace) -> dict[str, Any]:
    engine = PromptCache.from_pretrained()
    engine.stop_token_ids.clear()  # every mode decodes exactly --new-tokens tokens
    pool = records(args.data, args.skip, max(args.callers), args.passages, args.set, overlap=args.overlap)
    prompts_all = [(question, engine.add_documents(passages, progress=False)) for question, passages in pool]
    report: dict[str, Any] = {"info": run_info(engine, "SmolLM2-135M-Instruct (embedded)"), "settings": settings(args),
                              "rows": []}
    serve(engine, "sequential", [build_prompt(q, n) for q, n in prompts_all[:2]], 4)  # warm-up
    for n in args.callers:
        prompts = [build_prompt(q, names) for q, names in prompts_all[:n]]
        tokens = statistics.mean(len(engine.plan(p).input_ids) for p in prompts)
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
        for repeat in range(args.repeats):
            order = args.modes[repeat % len(args.modes):] + args.modes[: repeat % len(args.modes)]
            for mode in order:
                runs[mode].append(serve(engine, mode, prompts, args.new_tokens))
        row = {"callers": n, "prompt_tokens": tokens,
               "modes": {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    report["scheduler"] = engine.scheduler.stats()
    return report


class TransformersBatching:
    """transformers' own continuous batching (``ContinuousBatchingManager``: paged attention over
    the full prompt's token ids, no module KV) on the same model, answering one request at a time
    to threads: ``generate(token_ids)`` blocks until that request's last token."""

    def __init__(self, new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        from pc_rag.model.loading import default_model_dir

        model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32, attn_implementation="sdpa").eval()
        # no end-of-sequence token: every request decodes exactly new_tokens, as in the other modes
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        self.manager = model.init_continuous_batching(generation_config=config)
        self.manager.start()
        self.new_tokens = new_tokens
        self._done: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._count = 0
        self._collector = threading.Thread(target=self._collect, daemon=True)
        self._collector.start()

    def _collect(self) -> None:
        while self.manager.is_running():
            result = self.manager.get_result(timeout=0.1)
            if result is not None and result.is_finished():
                assert result.error is None and len(result.generated_tokens) == self.new_tokens, result
                with self._lock:
                    self._done.pop(result.request_id).set()

    def generate(self, token_ids: list[int]) -> None:
        done = threading.Event()
        with self._lock:
            self._count += 1
            request_id = f"r{self._count}"
            self._done[request_id] = done
        self.manager.add_request(list(token_ids), request_id=request_id, max_new_tokens=self.new_tokens)
        done.wait()

    def close(self) -> None:
        self.manager.stop(block=True)


def arrivals(args: argparse.Namespace) -> dict[str, Any]:
    """Requests arriving as a Poisson process at increasing rates: p95 latency (arrival to last
    token) per rate, for the scheduler, for one-at-a-time serving (a lock around ``generate``:
    each request waits for the one before it, as a server without batching serves them) and for
    transformers' continuous batching over the same prompts' full token ids; the sustainable rate
    is the highest whose p95 latency stays within ``--p95-bound``.

    Each rate runs ``--repeats`` Poisson draws (seeds ``--seed``, ``--seed + 1``, ...); every draw
    serves the modes one after another, their order rotating between draws, so that a slower
    stretch of the machine falls on every mode alike. A rate's p95 and mean are the medians over
    the draws (each draw's kept in ``draws``)."""
    from pc_rag.decode import loop

    engine, prompts = rag_engine(args)
    row_extents = loop._extents
    token_ids = [engine.plan(p).input_ids for p in prompts]  # what full prefill reads: the same tokens
    one_at_a_time = threading.Lock()
    report: dict[str, Any] = {"info": run_info(engine, "SmolLM2-135M-Instruct (embedded)"),
                              "settings": settings(args),
                              "prompt_tokens_mean": statistics.mean(len(ids) for ids in token_ids), "modes": {}}
    fused = engine.scheduler.limits
    counted = ("steps", "merges", "in_place", "chunks", "fused")

    def draw(mode: str, offsets: list[float]) -> dict[str, float]:
        """One Poisson draw served in ``mode``: p95 and mean latency, arrival to last token."""
        # "scheduler, prefill between steps": the same loop with a newcomer's prefill in passes of its own
        engine.scheduler.limits = replace(fused, fuse_prefill=mode != UNFUSED)
        # WHOLE_WIDTH: every decode step one attention call over the batch's whole width (before row extents)
        loop._extents = (lambda *_: None) if mode == WHOLE_WIDTH else row_extents
        transformers_cb = TransformersBatching(args.new_tokens) if mode == "transformers CB" else None
        if transformers_cb is not None:
            transformers_cb.generate(token_ids[0])  # warm-up

        def answer(index: int) -> None:
            if transformers_cb is not None:
                transformers_cb.generate(token_ids[index])
            elif mode.startswith("scheduler"):
                engine.generate(prompts[index], max_new_tokens=args.new_tokens)
            else:
                with one_at_a_time:
                    engine.generate(prompts[index], max_new_tokens=args.new_tokens)

        before = engine.scheduler.stats()
        try:
            latencies = on_schedule(offsets, answer)
        finally:
            if transformers_cb is not None:
                transformers_cb.close()
            engine.scheduler.limits = fused
            loop._extents = row_extents
        after = engine.scheduler.stats()
        return {"p95_latency_s": p95(latencies), "mean_latency_s": statistics.mean(latencies),
                **({k: after[k] - before[k] for k in counted} if mode.startswith("scheduler") else {})}

    modes = list(args.arrival_modes)
    rows: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for rate in args.rates:
        # a mode whose p95 passed twice the bound is saturated: a higher rate only queues longer
        live = [m for m in modes if not rows[m] or rows[m][-1]["p95_latency_s"] <= 2 * args.p95_bound]
        if not live:
            break
        draws: dict[str, list[dict[str, float]]] = {mode: [] for mode in live}
        for repeat in range(args.repeats):
            offsets = poisson_offsets(rate, len(prompts), args.seed + repeat)
            for mode in live[repeat % len(live):] + live[: repeat % len(live)]:
                draws[mode].append(draw(mode, offsets))
                print(json.dumps({"mode": mode, "rate": rate, "seed": args.seed + repeat, **draws[mode][-1]}), flush=True)
        for mode, runs in draws.items():
            rows[mode].append({"rate": rate, "p95_latency_s": statistics.median(r["p95_latency_s"] for r in runs),
                               "mean_latency_s": statistics.median(r["mean_latency_s"] for r in runs), "draws": runs})
    for mode in modes:
        within = [r["rate"] for r in rows[mode] if r["p95_latency_s"] <= args.p95_bound]
        report["modes"][mode] = {"rows": rows[mode], "sustainable_rate": max(within, default=0.0)}
        if mode.startswith("scheduler"):  # what the loop did over this mode's draws
            report["modes"][mode]["loop"] = {k: sum(d[k] for r in rows[mode] for d in r["draws"]) for k in counted}
        print(json.dumps({"mode": mode, "sustainable_rate": report["modes"][mode]["sustainable_rate"],
                          **report["modes"][mode].get("loop", {})}), flush=True)
    report["scheduler"] = engine.scheduler.stats()
    return report


def reads(args: argparse.Namespace) -> dict[str, Any]:
    """Cache entries read by the scheduler's decode steps against those its live rows hold, over
    one Poisson draw (``--seed``) per rate, each row reading the batch's whole width and within
    its extent (what a CPU step reads: :mod:`pc_rag.forward.row_extents`); counted by wrapping
    :meth:`RunningBatch.feed` (one host read of the rows' validity per step: the counts, not the
    timings, are the result)."""
    from pc_rag.decode import loop

    engine, prompts = rag_engine(args)
    steps: list[dict[str, int]] = []
    feed = loop.RunningBatch.feed

    def counted(batch: loop.RunningBatch, alongside: Any = None) -> Any:
        live = [row for row, request in enumerate(batch.requests) if not request.done]
        width = batch.cursor.end if batch.cursor.fixed else batch.length + 1  # what each row attends to
        held = int(batch.rows.valid[live, :width].sum()) + len(live) if live else 0  # + the entry this step writes
        ahead = max(0, width - batch.length - 1)
        # what the step reads with each row within its extent (pc_rag.forward.row_extents), where it applies
        extents = loop._extents(batch.rows, batch.cursor, batch.spec, [token is not None for token in batch.fed])
        within = batch.batch * width if extents is None else extents.entries
        steps.append({"read": batch.batch * width, "live": held, "finished_rows": (batch.batch - len(live)) * width,
                      "ahead_of_column": len(live) * ahead, "padding": len(live) * (width - ahead) - held, "read_within_extents": within})
        return feed(batch, alongside)

    report: dict[str, Any] = {"info": run_info(engine, "SmolLM2-135M-Instruct (embedded)"), "settings": settings(args), "rows": []}
    loop.RunningBatch.feed = counted  # type: ignore[method-assign]
    try:
        for rate in args.rates:
            steps.clear()
            latencies = on_schedule(poisson_offsets(rate, len(prompts), args.seed),
                                    lambda index: engine.generate(prompts[index], max_new_tokens=args.new_tokens))
            total = {key: sum(step[key] for step in steps) for key in steps[0]}
            row = {"rate": rate, "steps": len(steps), "p95_latency_s": p95(latencies),
                   "read_per_live_entry": total["read"] / total["live"],
                   "read_within_extents_per_live_entry": total["read_within_extents"] / total["live"],
                   **{f"{key}_share": total[key] / total["read"] for key in ("live", "finished_rows", "padding", "ahead_of_column")}}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        loop.RunningBatch.feed = feed  # type: ignore[method-assign]
    return report


def tiny_engine(**options: Any) -> PromptCache:
    """A tiny random Llama (its forward pass costs almost nothing) with the embedded tokenizer, stop tokens off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from pc_rag.model.loading import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    engine = PromptCache(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), tokenizer, **options)
    engine.stop_token_ids.clear()
    return engine


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Per decode step: the scheduler's loop against the bare loop, on a tiny model."""
    from pc_rag.decode.loop import decode
    from pc_rag.decode.request import SamplingParams

    engine = tiny_engine()
    prompt, steps = "A prompt of a few words to decode after.", args.steps
    bare, scheduled = [], []
    for _ in range(args.repeats):
        # bare: the decode loop over rows prefilled the same way, no scheduler, no thread
        plans = engine._prepare([prompt], True)
        ticket = engine._ticket(plans, SamplingParams(max_new_tokens=steps), True, time.perf_counter(), share=False)
        prefilled = engine._prefill(plans, steps, True, share=False)
        started = time.perf_counter()
        for _ in decode(engine.forward, prefilled.rows, ticket.requests, prefilled.logits, engine.spec):
            pass
        bare.append((time.perf_counter() - started) / steps)
        engine.buffers.release(prefilled.rows.buffer)
        result = engine.generate(prompt, max_new_tokens=steps)
        scheduled.append((result.stats.total_s - result.stats.ttft_s) / (steps - 1))
    report = {"steps": steps, "bare_ms_per_step": 1e3 * statistics.median(bare),
              "scheduler_ms_per_step": 1e3 * statistics.median(scheduled)}
    report["added_ms_per_step"] = report["scheduler_ms_per_step"] - report["bare_ms_per_step"]
    print(json.dumps(report))
    return report


def compiled(args: argparse.Namespace) -> dict[str, Any]:
    """A compiled decode step under callers that come and go (a tiny model, so compilation and
    the loop dominate), served as they come and after ``engine.warm_up()``: the compilations
    while serving, the first caller's latency (its 8 tokens), the step shapes served, the steps run compiled, the
    requests failed and whether every caller's tokens equal eager serving's. Each mode compiles
    with torch's on-disk caches empty (a server's first start on a machine; otherwise a mode
    finds the one before it's compilations), and the warm-up is timed once more with the cache
    that mode filled kept (a restarted server)."""
    from torch._dynamo.utils import counters

    callers = max(args.callers)
    # plain prompts of growing lengths and budgets, so the batch's rows and capacity change as
    # callers join and leave, and every other one over two documents (under compile batched rows
    # copy the modules they import, and APE's bias makes their mask a float one)
    docs = [f"Harbour {i} handles {i * 11} ships a day and lies {i * 3} km from the old town." for i in range(8)]
    report: dict[str, Any] = {"callers": callers}
    tokens: dict[str, list[Any]] = {}
    for mode in ("eager", "compiled", "compiled after warm-up"):
        with empty_compile_cache():
            engine = tiny_engine(compile=mode != "eager")
            torch._dynamo.reset()
            counters.clear()
            warm_up_s = engine.warm_up().seconds if mode == "compiled after warm-up" else 0.0
            report[mode], tokens[mode] = serve_arrivals(engine, callers, docs, counters)
            report[mode]["warm_up_s"] = warm_up_s
            if mode == "compiled after warm-up":
                torch._dynamo.reset()  # what a new process compiles, its on-disk caches filled
                report[mode]["warm_up_s_cache_kept"] = tiny_engine(compile=True).warm_up().seconds
        print(json.dumps({mode: report[mode]}), flush=True)
    report["tokens_equal_eager"] = tokens["compiled"] == tokens["eager"] == tokens["compiled after warm-up"]
    print(json.dumps({"tokens_equal_eager": report["tokens_equal_eager"]}))
    return report


@contextlib.contextmanager
def empty_compile_cache() -> Iterator[None]:
    """torch.compile's on-disk caches in a new, empty folder for the block, removed after it."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with tempfile.TemporaryDirectory(prefix="pcrag-inductor-") as folder, temporary_cache_dir(folder):
        yield


def serve_arrivals(engine: PromptCache, callers: int, docs: list[str], counters: Any) -> tuple[dict[str, Any], list[Any]]:
    """Part ``compiled``'s callers, each arriving once the one before it is decoding: what the
    serving compiled and ran, and each caller's tokens (or its error)."""
    names = engine.add_documents(docs, ids=[f"h{i}" for i in range(len(docs))], progress=False)
    prompts = [build_prompt(f"Caller {i} asks about harbours", names[i % 6 : i % 6 + 2]) if i % 2 else
               f"Caller {i} asks: " + " ".join(["word"] * (5 + 23 * i)) for i in range(callers)]
    before, stats_before, compiled_before = counters["frames"].get("ok", 0), engine.scheduler.stats(), engine.forward.compiled_steps
    shapes: set[tuple[int, int]] = set()
    step = engine.forward.decode_batch

    def recorded(buffer: Any, ids: torch.Tensor, *rest: Any) -> torch.Tensor:
        shapes.add((ids.shape[0], len(buffer)))
        return step(buffer, ids, *rest)

    engine.forward.decode_batch = recorded  # type: ignore[method-assign]
    joined = [threading.Event() for _ in range(callers)]
    out: list[Any] = [None] * callers
    latency: list[float] = [0.0] * callers

    def call(i: int) -> None:
        if i:
            joined[i - 1].wait()  # each caller arrives once the one before it is decoding
        try:
            stream = engine.stream(prompts[i], max_new_tokens=8 + 4 * i)
            for n, _ in enumerate(stream):
                if n == 0:
                    joined[i].set()
            out[i] = stream.result.token_ids
            latency[i] = stream.result.stats.total_s
        except Exception as err:  # noqa: BLE001 - counted: a failed step fails its callers
            out[i] = repr(err)
            joined[i].set()

    started = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(call, range(callers)))
    stats = engine.scheduler.stats()
    limit_hits = sum(v for k, v in counters["unimplemented"].items() if "recompile limit" in k.lower())
    report = {"wall_s": time.perf_counter() - started,
              "compilations": counters["frames"].get("ok", 0) - before,  # while serving
              "first_caller_s": latency[0], "recompile_limit_hit": limit_hits, "step_shapes": len(shapes),
              "compiled_steps": engine.forward.compiled_steps - compiled_before,
              **{key: stats[key] - stats_before[key] for key in ("steps", "merges", "in_place")},
              "compiled_shapes": sorted(engine.forward.compiled_shapes),  # a CUDA graph each under "reduce-overhead"
              "failed": sum(isinstance(o, str) for o in out),
              "errors": sorted({o for o in out if isinstance(o, str)})}
    return report, out


def warmed(args: argparse.Namespace) -> dict[str, Any]:
    """The embedded model compiled: ``warm_up()``'s time with torch's on-disk caches empty, then
    RAG callers' compilations (none expected), then the warm-up of a second engine with the
    caches the first filled (a restarted server)."""
    from torch._dynamo.utils import counters

    with empty_compile_cache():
        engine = PromptCache.from_pretrained(compile=True)
        counters.clear()
        warm = engine.warm_up()
        report: dict[str, Any] = {"warm_up_s": warm.seconds, "warm_up_compilations": counters["frames"].get("ok", 0),
                                  "warm_up_shapes": warm.shapes}
        print(json.dumps(report), flush=True)
        callers = max(args.callers)
        pool = records(args.data, args.skip, callers, args.passages, args.set)
        prompts = [build_prompt(q, engine.add_documents(passages, progress=False)) for q, passages in pool]
        before = counters["frames"].get("ok", 0)
        started = time.perf_counter()
        with ThreadPoolExecutor(callers) as workers:
            list(workers.map(partial(engine.generate, max_new_tokens=args.new_tokens), prompts))
        report["callers_wall_s"] = time.perf_counter() - started
        engine.generate_batch(prompts[:3], max_new_tokens=args.new_tokens)
        report.update(compilations_while_serving=counters["frames"].get("ok", 0) - before, shapes_served=sorted(engine.forward.compiled_shapes),
                      compiled_steps=engine.forward.compiled_steps, steps=engine.scheduler.stats()["steps"])
        del engine
        torch._dynamo.reset()
        report["warm_up_s_cache_kept"] = PromptCache.from_pretrained(compile=True).warm_up().seconds
    print(json.dumps(report), flush=True)
    return report


def table(report: dict[str, Any]) -> str:
    modes = list(report["rows"][0]["modes"])
    lines = ["| callers | prompt tokens | " + " | ".join(f"{m}: wall s / tok/s / mean TTFT s / mean latency s / p95 latency s" for m in modes) + " |",
             "|---:|---:|" + "---|" * len(modes)]
    for row in report["rows"]:
        cells = [f"{m['wall_s']:.2f} / {m['tokens_per_s']:.1f} / {m['ttft_mean_s']:.2f} / {m['latency_mean_s']:.2f} / {m['latency_p95_s']:.2f}"
                 for m in row["modes"].values()]
        lines.append(f"| {row['callers']} | {row['prompt_tokens']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fused(args: argparse.Namespace) -> dict[str, Any]:
    """One step that admits a newcomer: its prefill then the running rows' decode step as two
    passes, against both in one packed pass (what the scheduler runs), for running batches of
    ``--callers`` rows; median of ``--repeats``, the two orders alternating."""
    from pc_rag.decode import layout
    from pc_rag.decode.loop import RunningBatch
    from pc_rag.decode.request import SamplingParams
    from pc_rag.prefill.passes import chunks_of, new_tokens, prefill

    engine = PromptCache.from_pretrained()
    engine.stop_token_ids.clear()
    pool = records(args.data, args.skip, max(args.callers) + 1, args.passages, args.set)
    prompts = [build_prompt(q, engine.add_documents(passages, progress=False)) for q, passages in pool]

    def running(prompt: str) -> RunningBatch:
        plans = engine._prepare([prompt], True)
        ticket = engine._ticket(plans, SamplingParams(max_new_tokens=1000), True, 0.0, share=False)
        prefilled = engine._prefill(plans, 1000, True, share=False)
        return RunningBatch(engine.forward, prefilled.rows, ticket.requests, prefilled.logits, engine.spec)

    newcomer = engine._prepare([prompts[-1]], True)
    report: dict[str, Any] = {"info": run_info(engine, "SmolLM2-135M-Instruct (embedded)"), "settings": settings(args),
                              "newcomer_computed_tokens": newcomer[0].computed_tokens, "rows": []}
    for rows in args.callers:
        batch = layout.combine([(running(p), [0]) for p in prompts[:rows]])
        times: dict[str, list[float]] = {"decode step": [], "two passes": [], "one packed pass": []}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for mode in (("two passes", "one packed pass") if repeat % 2 else ("one packed pass", "two passes")):
                assembled, _ = engine._assemble_plain(newcomer, 32, True, True, layout.held(batch))
                chunk = chunks_of(assembled.rows, assembled.inputs, engine.scheduler.limits.max_step_tokens)[0]
                batch.take()
                started = time.perf_counter()
                if mode == "two passes":
                    prefill(engine.forward, assembled.rows, chunk, engine.spec)
                    batch.feed()
                else:
                    batch.feed(alongside=new_tokens(assembled.rows, chunk, engine.spec))
                if repeat:
                    times[mode].append(time.perf_counter() - started)
                engine.buffers.release(assembled.rows.buffer)
            batch.take()
            started = time.perf_counter()
            batch.feed()
            if repeat:
                times["decode step"].append(time.perf_counter() - started)
        row = {"rows": rows, "batch_length": batch.length, **{f"{m} ms": 1e3 * statistics.median(t) for m, t in times.items()}}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    return report


def extents(args: argparse.Namespace) -> dict[str, Any]:
    """A decode step over rows of private prompts, rebuilt as the scheduler rebuilds a batch: each
    row attending within its own entries (:mod:`pc_rag.forward.row_extents`) against one attention
    call over the batch's whole width, median of ``--steps`` steps each, the two alternating. Two
    layouts: ``even``, every prompt of ``--passages`` passages and every row decoding (what the
    extents cannot shorten: their cost alone), and ``spread``, prompts of a quarter to all of the
    passages and a quarter of the rows finished, waiting for a newcomer to take their slot."""
    from pc_rag.decode import layout as batch_layout
    from pc_rag.decode import loop
    from pc_rag.decode.request import SamplingParams

    engine = PromptCache.from_pretrained()
    engine.stop_token_ids.clear()
    pool = records(args.data, args.skip, max(args.callers), args.passages, args.set)
    documents = [(q, engine.add_documents(passages, progress=False)) for q, passages in pool]

    def running(prompt: str, budget: int) -> loop.RunningBatch:
        plans = engine._prepare([prompt], True)
        ticket = engine._ticket(plans, SamplingParams(max_new_tokens=budget), True, 0.0, share=False)
        prefilled = engine._prefill(plans, budget, True, share=False)
        return loop.RunningBatch(engine.forward, prefilled.rows, ticket.requests, prefilled.logits, engine.spec)

    row_extents = loop._extents
    report: dict[str, Any] = {"info": run_info(engine, "SmolLM2-135M-Instruct (embedded)"), "settings": settings(args), "rows": []}
    for rows, layout in ((rows, layout) for rows in args.callers for layout in ("even", "spread")):
        spread = layout == "spread"
        finished = rows // 4 if spread else 0
        kept = [names[: max(1, len(names) * (1 + i % 4) // 4)] if spread else names for i, (_, names) in enumerate(documents[:rows])]
        batch = batch_layout.combine([(running(build_prompt(q, names), 1 if i < finished else 2 * args.steps + 8), [0])
                                           for i, ((q, _), names) in enumerate(zip(documents, kept))])
        batch.take()
        batch.feed()  # the finished rows' last token
        times: dict[str, list[float]] = {"whole width": [], "row extents": []}
        try:
            for step in range(2 * args.steps + 2):  # the first two warm up
                mode = ("whole width", "row extents")[step % 2]
                loop._extents = row_extents if mode == "row extents" else (lambda *_: None)
                batch.take()
                started = time.perf_counter()
                batch.feed()
                if step >= 2:
                    times[mode].append(time.perf_counter() - started)
        finally:
            loop._extents = row_extents
        live = [row for row, alive in enumerate(batch.alive) if alive]
        held = int(batch.rows.valid[live, : batch.length].sum())
        within = row_extents(batch.rows, batch.cursor, batch.spec, batch.alive)  # None: not worth it, one call
        row = {"rows": rows, "layout": layout, "finished_rows": finished, "batch_length": batch.length,
               "live_share": held / (rows * batch.length),
               "extents_read_share": None if within is None else within.entries / (rows * batch.cursor.end),
               **{f"{m} ms": 1e3 * statistics.median(t) for m, t in times.items()}}
        row["ratio"] = row["row extents ms"] / row["whole width ms"]
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    return report


PLOTTED = {  # panel title: [(result file, dashed: every prompt imports the same passages), ...]
    "~1K-token prompts, callers at once": [("serving_concurrency.json", False), ("serving_concurrency_overlap.json", True)],
    "~3.7K-token prompts, callers at once": [("serving_concurrency_4k.json", False), ("serving_concurrency_4k_overlap.json", True)],
    "~2K-token prompts, Poisson arrivals": [("serving_arrivals_2k_small_batch.json", False), ("serving_arrivals_2k_overlap.json", True),
                                           ("serving_arrivals_2k_overlap_transformers_cb.json", True)],
}


def plot(folder: Path, path: Path) -> None:
    """The results in ``folder`` as one figure: per panel, mean latency against callers (or p95
    latency against request rate) for every mode; solid lines each prompt its own passages,
    dashed every prompt the same passages. A result file not there is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(6 * len(PLOTTED), 4.5))
    colours: dict[str, str] = {}
    for ax, (title, files) in zip(axes, PLOTTED.items()):
        named: set[str] = set()
        for file, dashed in files:
            if not (folder / file).exists():
                continue
            report = json.loads((folder / file).read_text())
            style = "s--" if dashed else "o-"
            if "rows" in report:  # callers at once
                series = {mode: ([row["callers"] for row in report["rows"]], [row["modes"][mode]["latency_mean_s"] for row in report["rows"]])
                          for mode in report["rows"][0]["modes"]}
                ax.set_xlabel("concurrent callers")
                ax.set_ylabel("mean latency (s)")
            else:  # arrivals
                series = {mode: ([r["rate"] for r in result["rows"]], [r["p95_latency_s"] for r in result["rows"]])
                          for mode, result in report["modes"].items()}
                ax.axhline(report["settings"]["p95_bound"], color="grey", lw=0.8, ls=":")
                ax.set_xlabel("requests/s (Poisson)")
                ax.set_ylabel("p95 latency (s, log scale)")
                ax.set_yscale("log")
            for mode, (xs, ys) in series.items():
                # one legend entry per mode: the line style says which passages
                line, = ax.plot(xs, ys, style, color=colours.get(mode), label="_nolegend_" if mode in named else mode)
                colours.setdefault(mode, line.get_color())
                named.add(mode)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M on a 2-core CPU, 32 new tokens per request (benchmarks/serving.py); "
                 "solid: each prompt its own passages, dashed: every prompt the same passages", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def linear(args: argparse.Namespace) -> dict[str, Any]:
    """Decode-sized linear layers (``pc_rag.weights.small_batch``): one sweep over the embedded
    model's linear layers for ``--callers`` rows, ``F.linear`` against ``W @ x^T``; then a decode
    step of that many rows (``generate_batch``, per-step time from its stats; with ``--overlap``
    the prompts import the same passages) with ``small_batch_linear`` off and on; median of ``--repeats``."""
    import torch.nn.functional as F

    from pc_rag.weights import small_batch

    engine = PromptCache.from_pretrained(small_batch_linear=False)
    engine.stop_token_ids.clear()
    layers = [m for m in engine.model.modules() if type(m) is torch.nn.Linear]
    report: dict[str, Any] = {"info": run_info(engine, "SmolLM2-135M-Instruct (embedded)"), "settings": settings(args),
                              "weight_mb": sum(m.weight.numel() * m.weight.element_size() for m in layers) / 1e6, "sweep": [], "step": []}

    def sweep(rows: int, product: Any) -> float:
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
        times = []
        with torch.inference_mode():
            for repeat in range(args.repeats + 1):
                started = time.perf_counter()
                for m in layers:
                    product(inputs[m.in_features], m.weight)
                if repeat:  # the first warms up
                    times.append(time.perf_counter() - started)
        return 1e3 * statistics.median(times)

    for rows in args.callers:
        row = {"rows": rows, "F.linear ms": sweep(rows, lambda x, w: F.linear(x, w)),
               "W @ x^T ms": sweep(rows, lambda x, w: torch.mm(w, x.t()))}
        report["sweep"].append(row)
        print(json.dumps(row), flush=True)
    pool = records(args.data, args.skip, max(args.callers), args.passages, args.set, overlap=args.overlap)
    prompts = [build_prompt(q, engine.add_documents(passages, progress=False)) for q, passages in pool]
    engine.generate(prompts[0], max_new_tokens=4)
    for rows in args.callers:
        per_step: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(args.repeats):
            for on in (False, True) if repeat % 2 else (True, False):  # the two orders alternate
                small_batch.install(engine.model, on)
                results = engine.generate_batch(prompts[:rows], max_new_tokens=args.new_tokens)
                per_step[on].append(statistics.median((r.stats.total_s - r.stats.ttft_s) / (len(r.token_ids) - 1) for r in results))
        row = {"rows": rows, **{f"step ms, small_batch_linear={on}": 1e3 * statistics.median(t) for on, t in per_step.items()}}
        report["step"].append(row)
        print(json.dumps(row), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("concurrency", "arrivals", "reads", "overhead", "compiled", "fused", "linear", "extents",
                                                 "warm-up", "plot"))
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the data sets (benchmarks/data/README.md)")
    parser.add_argument("--set", choices=tuple(SETS), default="hotpotqa", help="the QA set the prompts come from")
    parser.add_argument("--skip", type=int, default=100, help="records skipped (HotpotQA-more's first 100 were used in development)")
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["sequential", "generate_batch", "threads", "langchain ainvoke"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--overlap", action="store_true", help="every prompt imports the same passages")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (arrivals: Poisson draws per rate)")
    parser.add_argument("--steps", type=int, default=200, help="overhead: decode steps per request; extents: steps per mode")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0], help="arrivals, reads: requests/s")
    parser.add_argument("--requests", type=int, default=16, help="arrivals, reads: requests per rate")
    parser.add_argument("--arrival-modes", nargs="+", default=["scheduler", UNFUSED, "one at a time", "transformers CB"],
                        help="arrivals: how requests are served")
    parser.add_argument("--p95-bound", type=float, default=6.0, help="arrivals: the p95 latency a sustainable rate keeps (s)")
    parser.add_argument("--seed", type=int, default=0, help="arrivals, reads: the first draw's seed (arrivals' draw k: seed + k)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.part == "plot":  # from the results already written: nothing is run
        folder = ROOT / "benchmarks" / "results"
        plot(folder, args.out or folder / "serving.png")
        return
    torch.set_num_threads(2)
    report = {"concurrency": concurrency, "arrivals": arrivals, "reads": reads, "overhead": overhead, "compiled": compiled, "fused": fused, "linear": linear,
              "extents": extents, "warm-up": warmed}[args.part](args)
    out = args.out or ROOT / f"benchmarks/results/serving_{args.part}{'_overlap' if args.overlap else ''}.json"
    out.write_text(json.dumps(report, indent=1))
    if args.part == "concurrency":
        print(table(report))


if __name__ == "__main__":
    main()
