"""``pc-rag``: command-line entry points (``generate``, ``demo``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from .engine import ENCODINGS, PromptCache
from .errors import PromptCacheError
from .generation import Generation
from .model import cache_root
from .pml import escape

DEMO_MODULES = ("json", "csv", "argparse", "logging", "pathlib", "sqlite3")
DEMO_QUESTIONS = (
    (("json",), "How do I turn a Python object into a JSON string?"),
    (("csv",), "Which class reads CSV rows as dictionaries?"),
    (("argparse", "logging"), "What are these two modules for?"),
    (("pathlib", "sqlite3", "json"), "Which of these modules works with file system paths?"),
)


def _read_text(value: str) -> str:
    """A file's content if ``value`` names an existing file, else ``value`` itself."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    return value


def _engine(args: argparse.Namespace) -> PromptCache:
    return PromptCache.from_pretrained(
        args.model, device=args.device, encoding=args.encoding, cache_dir=args.cache_dir
    )


def _print_stats(label: str, result: Generation) -> None:
    s = result.stats
    print(
        f"[{label}] cached {s.cached_tokens} / computed {s.computed_tokens} tokens, "
        f"TTFT {s.ttft_s * 1000:.1f} ms (assembly {s.assemble_s * 1000:.1f} ms), "
        f"{s.generated_tokens} tokens in {s.total_s:.2f} s, modules: {', '.join(s.modules) or '-'}"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _engine(args)
    for schema in args.schema:
        engine.add_schema(_read_text(schema))
    prompt = _read_text(args.prompt)
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


def demo_schema() -> str:
    """A schema whose modules are the docstrings of a few standard-library modules."""
    parts = ['<schema name="stdlib-docs">', "<system>You are a concise Python expert. Answer from the documentation.</system>", "<user>"]
    for name in DEMO_MODULES:
        doc = (importlib.import_module(name).__doc__ or "").strip()
        parts.append(f'<module name="{name}">Documentation of the {name} module:\n{escape(doc)}\n</module>')
    parts.append("</user></schema>")
    return "\n".join(parts)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.cache_dir is None:
        args.cache_dir = str(cache_root() / "kv")
    engine = _engine(args)
    schema = engine.add_schema(demo_schema())
    print(f"schema {schema.name!r}: {len(schema.modules)} modules, {schema.layout.length} tokens (cache: {args.cache_dir})\n")
    for modules, question in DEMO_QUESTIONS:
        refs = "".join(f"<{m}/>" for m in modules)
        prompt = f'<prompt schema="stdlib-docs">{refs}<user>{escape(question)}</user></prompt>'
        cached = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
        full = engine.generate(prompt, max_new_tokens=args.max_new_tokens, use_cache=False)
        print(f"Q: {question}\nA: {cached.text.strip()}")
        _print_stats("cached", cached)
        _print_stats("full prefill", full)
        print(f"TTFT speedup: {full.stats.ttft_s / max(cached.stats.ttft_s, 1e-9):.1f}x; same answer as full prefill: {cached.text == full.text}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pc-rag", description="Prompt Cache: reuse attention states of prompt modules.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="hub id or local folder (default: embedded SmolLM2-135M-Instruct)")
    common.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    common.add_argument("--encoding", choices=ENCODINGS, default=None, help="module encoding mode")
    common.add_argument("--cache-dir", default=None, help="persist module KV here")
    common.add_argument("--max-new-tokens", type=int, default=64)
    common.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", parents=[common], help="answer one PML (or plain) prompt")
    gen.add_argument("--schema", action="append", default=[], help="schema file or PML text (repeatable)")
    gen.add_argument("--prompt", required=True, help="prompt file or text")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--no-cache", action="store_true", help="full prefill of the same tokens (the baseline)")
    mode.add_argument("--compare", action="store_true", help="run cached and full prefill and print the TTFT speedup")
    gen.set_defaults(func=cmd_generate)
    demo = sub.add_parser("demo", parents=[common], help="cached vs full prefill on standard-library documentation")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except PromptCacheError as exc:
        print(f"pc-rag: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
