"""Per-token cost of JSON-schema constrained decoding on this machine: xgrammar vs llguidance.

Both libraries walk the same valid JSON answer token by token, as the decode loop would: compute
the allowed-token mask, apply it to a row of logits, accept the token. Reported: tokenizer setup (once
per engine), schema compile (once per schema) and the median per-token cost, against the median time of one decode step of the model.
Then pc-rag's own matcher (llguidance plus the budget check that closes a document before
``max_new_tokens`` ends it, :mod:`pc_rag.decode.constrained`) walks the same answer with a budget a few
tokens above its length (the budget check steers no token) and with a loose one.

    python benchmarks/structured_overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pc_rag import PromptCache

SCHEMA = {
    "title": "Answer",
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "sources": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["fact", "opinion", "unknown"]},
    },
    "required": ["answer", "confidence", "sources", "kind"],
}
ANSWER = json.dumps({"answer": "Santa Clara, California, at Levi's Stadium", "confidence": 0.92,
                     "sources": ["doc-1", "doc-7"], "kind": "fact"})


def bench_xgrammar(tokenizer, vocab: int, tokens: list[int], repeats: int) -> tuple[float, float, float]:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - started
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.randn(1, vocab)
    per_token = []
    for _ in range(repeats):
        matcher = xgr.GrammarMatcher(compiled)
        started = time.perf_counter()
        for token in tokens:
            matcher.fill_next_token_bitmask(bitmask)
            row = logits.clone()
            xgr.apply_token_bitmask_inplace(row, bitmask)
            assert matcher.accept_token(token)
        per_token.append((time.perf_counter() - started) / len(tokens))
    return setup_s, compile_s, statistics.median(per_token)


def bench_llguidance(tokenizer, vocab: int, tokens: list[int], repeats: int) -> tuple[float, float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup_s = time.perf_counter() - started
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    llguidance.LLMatcher(lltok, grammar)  # llguidance compiles lazily, when a matcher is made
    compile_s = time.perf_counter() - started
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    logits = torch.randn(1, vocab)
    bits = torch.arange(32, dtype=torch.int32)
    per_token = []
    for _ in range(repeats):
        matcher = llguidance.LLMatcher(lltok, grammar)
        started = time.perf_counter()
        for token in tokens:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            # llguidance's own apply kernel needs torch.compile (a C compiler); the same unpacking by tensor ops
            allowed = ((bitmask[0, :, None] >> bits) & 1).flatten()[:vocab].bool()
            logits.clone().masked_fill_(~allowed, float("-inf"))
            assert matcher.consume_token(token), matcher.get_error()
        per_token.append((time.perf_counter() - started) / len(tokens))
    return setup_s, compile_s, statistics.median(per_token)


def bench_pc_rag(engine: PromptCache, tokens: list[int], repeats: int, budget: int) -> float:
    from pc_rag.decode.constrained import schema_text

    vocabulary = engine._vocabulary
    schema = schema_text(SCHEMA)
    vocabulary.matcher(schema).closing()  # the closing walk's tables, built once per engine
    logits = torch.randn(engine.model.config.vocab_size)
    per_token = []
    for _ in range(repeats):
        matcher = vocabulary.matcher(schema)
        started = time.perf_counter()
        for step, token in enumerate(tokens):
            matcher.mask(logits)
            assert matcher.within(token, budget - step) == token
            matcher.accept(token)
        per_token.append((time.perf_counter() - started) / len(tokens))
    return statistics.median(per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    engine = PromptCache.from_pretrained()
    tokenizer = engine.tokenizer
    vocab = engine.model.config.vocab_size
    tokens = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    step = []
    for _ in range(args.repeats):
        result = engine.generate("Where was Super Bowl 50 played?", max_new_tokens=32, use_cache=False, min_new_tokens=32)
        step.append((result.stats.total_s - result.stats.ttft_s) / max(1, result.stats.generated_tokens - 1))
    decode_step = statistics.median(step)
    print(f"decode step of the model: {decode_step * 1e3:.2f} ms (median of {args.repeats}); answer: {len(tokens)} tokens")
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            setup_s, compile_s, token_s = bench(tokenizer, vocab, tokens[:-1], args.repeats)
        except ImportError as err:  # xgrammar is in the "bench" extra only
            print(f"{name:11s} not installed ({err}): pip install -e '.[bench]'")
            continue
        print(f"{name:11s} tokenizer setup {setup_s * 1e3:6.1f} ms   schema compile {compile_s * 1e3:6.1f} ms   per token {token_s * 1e6:7.1f} us"
              f"   = {100 * token_s / decode_step:4.1f}% of a decode step")
    for label, budget in (("tight", len(tokens) + 8), ("loose", 4 * len(tokens))):
        token_s = bench_pc_rag(engine, tokens[:-1], args.repeats, budget)
        print(f"pc-rag matcher, {label} budget ({budget} tokens): per token {token_s * 1e6:7.1f} us"
              f"   = {100 * token_s / decode_step:4.1f}% of a decode step")


if __name__ == "__main__":
    main()
