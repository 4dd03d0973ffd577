"""``pc-rag``: command-line entry points (``generate``, ``demo``, ``ask``, ``encode``, ``check``, ``serve``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

# light imports only: `pc-rag --help` answers without loading torch; commands import what they run
from .errors import PromptCacheError
from .paths import expand
from .prompt.layout import ENCODINGS
from .prompt.neighbours import CONTEXTS, DEFAULT_NEIGHBOURS
from .prompt.pml import PML, is_pml_prompt

if TYPE_CHECKING:
    from .decode.request import Generation
    from .demo import DemoRAG
    from .engine import PromptCache

logger = logging.getLogger(__name__)

_FILE_SUFFIXES = (".xml", ".pml", ".txt", ".md", ".prompt")


def _read_text(value: str, what: str, *, text_allowed: bool = True) -> str:
    """A file's content if ``value`` names an existing file (``~`` and variables expanded), else
    ``value`` itself as text. A value that can only be meant as a file (``what`` without text
    allowed, or a single word ending in .xml, .pml, .txt, .md) that names none is an error,
    raised before any model is loaded."""
    path = expand(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as err:
        raise PromptCacheError(f"{what} {value!r}: {err}") from err
    if text_allowed:
        meant_as_file = value.lower().endswith(_FILE_SUFFIXES) and not any(c.isspace() for c in value)
    else:
        meant_as_file = not value.lstrip().startswith("<")
    if meant_as_file:
        raise PromptCacheError(f"{what} file {value!r} not found" + ("" if text_allowed else " (or give PML text starting with '<')"))
    return value


def _engine(args: argparse.Namespace, **options: Any) -> PromptCache:
    from .engine import PromptCache

    return PromptCache.from_pretrained(
        args.model, device=args.device, encoding=args.encoding, kv_dir=args.kv_dir, remote_store=args.remote_store,
        kv_quantization=args.kv_quantization, weights=args.weights, kv_dtype=args.kv_dtype, **options,
    )


def _print_stats(label: str, result: Generation) -> None:
    s = result.stats
    print(
        f"[{label}] cached {s.cached_tokens} / computed {s.computed_tokens} tokens, "
        f"TTFT {s.ttft_s * 1000:.1f} ms (assembly {s.assemble_s * 1000:.1f} ms), "
        f"{s.generated_tokens} tokens in {s.total_s:.2f} s, modules: {', '.join(s.modules) or '-'}"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    # every file is read before the model loads: a wrong path fails in a second, not after loading
    schemas = [_read_text(schema, "schema", text_allowed=False) for schema in args.schema]
    prompt = _read_text(args.prompt, "prompt")
    if args.pml:  # markup only when asked for: plain text otherwise, whatever it looks like
        prompt = PML(prompt)
    elif is_pml_prompt(prompt):
        print("pc-rag: note: the prompt is read as plain text; pass --pml to read it as PML (<prompt schema=...>)", file=sys.stderr)
    engine = _engine(args)
    for schema in schemas:
        engine.add_schema(schema)
    modes = [True, False] if args.compare else [not args.no_cache]
    results = {}
    for use_cache in modes:
        label = "cached" if use_cache else "full prefill"
        result = engine.generate(prompt, max_new_tokens=args.max_new_tokens, use_cache=use_cache)
        results[label] = result
        print(result.text.strip())
        _print_stats(label, result)
    if args.compare:
        speedup = results["full prefill"].stats.ttft_s / max(results["cached"].stats.ttft_s, 1e-9)
        print(f"TTFT speedup: {speedup:.1f}x")
    return 0


def _demo(args: argparse.Namespace) -> DemoRAG:
    from .demo import DemoRAG
    from .paths import cache_root

    if args.kv_dir is None:
        args.kv_dir = str(cache_root())
    started = time.perf_counter()
    return DemoRAG(_engine(args), args, started=started)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DEMO_QUESTIONS, Agreement

    rag = _demo(args)
    rows = [rag.answer(question, compare=True) for question in DEMO_QUESTIONS]
    print(Agreement.totals([row for row in rows if row is not None]))
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    _demo(args).answer(args.question, compare=args.compare)
    return 0


def read_documents(paths: list[str]) -> list[dict[str, Any]]:
    """Documents from files: a text file is one document (its name, without suffix, the id), a
    JSONL file one per line (``text``, optional ``id`` and ``metadata``), a folder every
    ``.txt``/``.md``/``.jsonl`` file under it, in name order."""
    documents: list[dict[str, Any]] = []
    files: list[Path] = []
    for value in paths:
        path = expand(value)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md", ".jsonl") and p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise PromptCacheError(f"{value}: no such file or folder")
    for path in files:
        if path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise PromptCacheError(f"{path}:{number}: not JSON ({err})") from err
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise PromptCacheError(f"{path}:{number}: needs a string field 'text'")
                documents.append({"text": row["text"], "id": row.get("id"), "metadata": {**(row.get("metadata") or {}), "source": str(path)}})
        else:
            documents.append({"text": path.read_text(encoding="utf-8"), "id": None, "metadata": {"source": str(path)}})
    if not documents:
        raise PromptCacheError("no documents found in " + ", ".join(paths))
    return documents


def cmd_encode(args: argparse.Namespace) -> int:
    """Encode documents into the remote store (on Ray workers with ``--workers``), once for every replica."""
    from .demo import DEMO_SYSTEM

    documents = read_documents(args.files)
    texts = [d["text"] for d in documents]
    ids = [d["id"] for d in documents]
    metadatas = [d["metadata"] for d in documents]
    started = time.perf_counter()
    if args.workers:
        from .distributed import encode_documents

        names = encode_documents(texts, model=args.model, remote_store=args.remote_store, ids=ids, metadatas=metadatas,
                                 num_workers=args.workers, system=DEMO_SYSTEM, context=args.context, neighbours=args.neighbours,
                                 device=args.device, encoding=args.encoding, kv_quantization=args.kv_quantization)
    else:
        engine = _engine(args)
        names = engine.add_documents(texts, ids=ids, metadatas=metadatas, system=DEMO_SYSTEM, context=args.context, neighbours=args.neighbours)
        unwritten = engine.remote_backlog()
        if engine.remote is None or unwritten:
            raise PromptCacheError(f"{unwritten} entries or registry records could not be written to {args.remote_store} "
                                   "(is it reachable, and not full?)")
    print(f"encoded {len(names)} documents into {args.remote_store} in {time.perf_counter() - started:.1f} s "
          f"({args.workers or 'no'} Ray workers); serve them with: pc-rag ask --remote-store {args.remote_store} QUESTION")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import serve
    from .server.tenants import Tenants

    # a bad key file fails before the model loads
    key_bounds = {"max_in_flight": args.max_in_flight_per_key, "max_tokens_per_minute": args.max_tokens_per_minute_per_key}
    tenants = Tenants.from_file(expand(args.api_keys), **key_bounds) if args.api_keys else None
    limits = dict(max_running=args.max_running, max_step_tokens=args.max_step_tokens, max_queued=args.max_queued,
                  buffer_budget=None if args.buffer_budget_mb is None else int(args.buffer_budget_mb * 2**20),
                  encode_share=args.encode_share, learn_passages=args.learn_passages)
    memory_budget = None if args.memory_budget_mb is None else int(args.memory_budget_mb * 2**20)
    compile_mode = args.compile or False  # False: eager
    name = args.served_model_name or (Path(args.model.rstrip("/")).name if args.model else "SmolLM2-135M-Instruct")
    if args.replicas:
        from .server.replicas import run

        options = dict(device=args.device, encoding=args.encoding, kv_dir=args.kv_dir, remote_store=args.remote_store,
                       kv_quantization=args.kv_quantization, memory_budget=memory_budget, compile=compile_mode, weights=args.weights,
                       kv_dtype=args.kv_dtype, **limits)
        run(args.model, name, options, replicas=args.replicas, host=args.host, port=args.port,
            keys_file=str(expand(args.api_keys)) if args.api_keys else None, key_bounds=key_bounds,
            router=args.router)
        return 0
    engine = _engine(args, memory_budget=memory_budget, compile=compile_mode, **limits)
    if compile_mode:  # before the port opens: no caller waits for a compilation
        done = engine.warm_up()
        print(f"pc-rag: decode step compiled ({args.compile}) for {len(done.shapes)} shapes in {done.seconds:.1f} s", file=sys.stderr)
    serve(engine, host=args.host, port=args.port, tenants=tenants, model_name=name, body_timeout_s=args.body_timeout_s,
          shutdown_timeout_s=args.shutdown_timeout_s)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Exit 0 when the model is exact on every path pc-rag serves it by, 1 otherwise."""
    report = _engine(args).check(fidelity=not args.no_fidelity)
    print(report)
    return 0 if report.exact else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pc-rag", description="Prompt Cache: reuse attention states of prompt modules.")
    common = argparse.ArgumentParser(add_help=False)  # every command loads a model
    common.add_argument("--model", default=None, help="hub id, local folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    common.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    common.add_argument("--encoding", choices=ENCODINGS, default=None, help="module encoding mode")
    common.add_argument("--kv-dir", "--cache-dir", dest="kv_dir", default=None, help="persist module KV here (--cache-dir: its old name)")
    common.add_argument("--remote-store", default=None, metavar="URL",
                        help="share module KV and documents through Redis/Valkey (redis://HOST:PORT/DB)")
    common.add_argument("--kv-quantization", choices=("int8", "int4"), default=None,
                        help="store module KV in 8 or 4 bits in every tier (default: the model's precision)")
    common.add_argument("--kv-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="requests' KV buffers and module KV in 16 bits: half what a decode step reads (default: the model's dtype)")
    common.add_argument("--weights", choices=("float32", "float16", "int4", "int4-a8"), default=None,
                        help="a CPU model's linear layers in fp16 (half the bytes, float32 arithmetic) or 4 bits (the LM head in 8; "
                             "int4-a8: decode steps' inputs in 8 bits too); "
                             "default: int4 for the embedded model (its GGUF's own blocks; float16 without a C compiler), "
                             "as loaded for others")
    common.add_argument("-v", "--verbose", action="store_true", help="log progress")

    decoding = argparse.ArgumentParser(add_help=False)  # commands that generate
    decoding.add_argument("--max-new-tokens", type=int, default=96)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", parents=[common, decoding], help="answer one prompt (plain text, or PML with --pml)")
    gen.add_argument("--schema", action="append", default=[], help="schema file or PML text (repeatable)")
    gen.add_argument("--prompt", required=True, help="prompt file or text (plain text unless --pml)")
    gen.add_argument("--pml", action="store_true", help="read --prompt as a PML prompt (<prompt schema=...>)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--no-cache", action="store_true", help="full prefill of the same tokens (the baseline)")
    mode.add_argument("--compare", action="store_true", help="run cached and full prefill and print the TTFT speedup")
    gen.set_defaults(func=cmd_generate)
    rag = argparse.ArgumentParser(add_help=False)
    rag.add_argument("-k", type=int, default=3, help="documents retrieved per question")
    corpus = argparse.ArgumentParser(add_help=False)
    corpus.add_argument("--context", choices=CONTEXTS, default=None,
                        help="encode each document behind its nearest documents (whole, or their first sentences); "
                             "retrieved documents are then placed after the neighbour they were encoded behind")
    corpus.add_argument("--neighbours", type=int, default=DEFAULT_NEIGHBOURS, metavar="K", help="how many neighbours, with --context")
    demo = sub.add_parser("demo", parents=[common, decoding, rag, corpus], help="RAG over standard-library documentation: cached vs full prefill")
    demo.set_defaults(func=cmd_demo)
    ask = sub.add_parser("ask", parents=[common, decoding, rag, corpus], help="answer one question over the demo corpus (or, with --remote-store, its documents)")
    ask.add_argument("question")
    ask.add_argument("--compare", action="store_true", help="also run full prefill and print the TTFT speedup")
    ask.set_defaults(func=cmd_ask)
    encode = sub.add_parser("encode", parents=[common, corpus], help="encode documents into a remote store, for every replica")
    encode.add_argument("files", nargs="+", help="text files, JSONL files (a 'text' field per line) or folders")
    encode.add_argument("--workers", type=int, default=0, help="Ray workers (RAY_ADDRESS joins a cluster; 0: this process)")
    encode.set_defaults(func=cmd_encode)
    check = sub.add_parser("check", parents=[common], help="a conformance self-test of a model: every path exact, moved-module fidelity")
    check.add_argument("--no-fidelity", action="store_true", help="the exactness checks only")
    check.set_defaults(func=cmd_check)
    _add_serve(sub, common)
    return parser


# pc_rag.forward.forward.COMPILE_MODES, spelled out: importing it loads torch, which --help need not wait for
SERVE_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def _add_serve(sub: Any, common: argparse.ArgumentParser) -> None:
    """``pc-rag serve``'s options."""
    serve = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible HTTP server (chat and text completions, documents)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: localhost only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-keys", default=None, metavar="FILE",
                       help='JSON object {"KEY": ["collection", ...]}: clients send Authorization: Bearer KEY and see only '
                            'those collections (or {"KEY": {"collections": [...], "max_in_flight": N, "max_tokens_per_minute": M}}: '
                            'bounds of its own)')
    serve.add_argument("--max-in-flight-per-key", type=int, default=None, metavar="N",
                       help="generations each API key may have in flight at once; past it the key gets 429 while other keys "
                            "are served (default: no bound; a key's own max_in_flight in --api-keys wins)")
    serve.add_argument("--max-tokens-per-minute-per-key", type=int, default=None, metavar="N",
                       help="tokens (prompt and completion) each API key's generations may use per minute; past it the key gets "
                            "429 until enough of the minute has passed (default: no bound; a key's own max_tokens_per_minute wins)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients ask for (default: the model's name)")
    serve.add_argument("--max-running", type=int, default=16, help="rows decoding at once")
    serve.add_argument("--max-step-tokens", type=int, default=512, help="prompt tokens prefilled per scheduler step")
    serve.add_argument("--max-queued", type=int, default=256, help="requests waiting for admission; past it a request gets 429")
    serve.add_argument("--buffer-budget-mb", type=float, default=None, metavar="MB",
                       help="KV buffers of the requests served at once, per engine (default: no bound); "
                            "past it admission waits, and a request that alone needs more gets 400")
    serve.add_argument("--compile", choices=SERVE_COMPILE_MODES, default=None,
                       help="run decode steps through torch.compile in this mode (reduce-overhead: CUDA graphs on a GPU), "
                            "compiled for every batch size before the port opens (default: eager)")
    serve.add_argument("--body-timeout-s", type=float, default=30.0, help="a request body not received within this answers 408")
    serve.add_argument("--shutdown-timeout-s", type=float, default=10.0,
                       help="on SIGTERM: stop accepting, let requests in flight finish this long, then cancel the rest and exit")
    serve.add_argument("--encode-share", type=float, default=0.25,
                       help="share of the model's time documents are encoded in while requests run (all of it when idle)")
    serve.add_argument("--learn-passages", type=int, default=None, metavar="N",
                       help="a passage pasted into N prompts of one key is learned as that key's document and reused from then on "
                            "(default: never)")
    serve.add_argument("--memory-budget-mb", type=float, default=None, metavar="MB",
                       help="module KV held in memory, per engine (default: no bound; the least recently used leave first)")
    serve.add_argument("--replicas", type=int, default=0, metavar="N",
                       help="N engine replicas on Ray Serve (a local runtime, or the cluster RAY_ADDRESS names) over --remote-store")
    serve.add_argument("--router", choices=("affinity", "default"), default="affinity",
                       help="with --replicas: send a request to the replica that holds its documents, or Ray Serve's default")
    serve.set_defaults(func=cmd_serve)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve" and args.replicas and not args.remote_store:
        print("pc-rag: error: serve --replicas needs --remote-store URL (the Redis the replicas share)", file=sys.stderr)
        return 2
    for given, flag in ((getattr(args, "max_in_flight_per_key", None), "--max-in-flight-per-key"),
                        (getattr(args, "max_tokens_per_minute_per_key", None), "--max-tokens-per-minute-per-key")):
        if args.command == "serve" and given is not None and not args.api_keys:
            print(f"pc-rag: error: serve {flag} bounds each API key: it needs --api-keys FILE", file=sys.stderr)
            return 2
    if args.command == "encode" and not args.remote_store:
        print("pc-rag: error: encode needs --remote-store URL (where the replicas read the documents)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except PromptCacheError as exc:
        print(f"pc-rag: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
