"""The demo's RAG stack (``pc-rag demo`` and ``pc-rag ask``): standard-library passages as document
modules, pc-rag's FAISS index and a LangChain chain, each answer compared with full prefill's."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time
from typing import TYPE_CHECKING

from .errors import PromptCacheError

if TYPE_CHECKING:
    from .engine import PromptCache

logger = logging.getLogger(__name__)

DEMO_QUESTIONS = (
    "How do I turn a Python object into a JSON string?",
    "Which class reads CSV rows as dictionaries?",
    "How can I run a shell command and capture its output?",
    "How do I get the smallest item from a heap?",
    "How do I generate a random UUID?",
)
DEMO_SYSTEM = "You are a concise Python expert. Answer the question from the documentation passages."
CHAT_TEMPLATE = (("system", DEMO_SYSTEM), ("human", "Documentation:\n\n{context}\n\nQuestion: {question}"))
# decoding settings for the small embedded model (both the cached and the full-prefill run use them)
DEMO_REPETITION_PENALTY = 1.1
DEMO_NO_REPEAT_NGRAM = 0
DEMO_STOP = ["\n\n"]  # the end of the answer's first paragraph


class DemoRAG:
    """The demo's RAG stack: stdlib passages as document modules, FAISS, and a LangChain chain."""

    def __init__(self, engine: PromptCache, args: argparse.Namespace, *, started: float) -> None:
        """``args`` are the command line's (``--remote-store``, ``--context``, ``--k``, ...);
        ``started`` is when building ``engine`` began (the "ready in" line counts from it)."""
        from .corpus import Passage, stdlib_corpus
        from .retrievers import FaissModuleRetriever

        self.engine = engine
        shared = self.engine.schemas.get("docs")
        if args.remote_store and shared is not None and shared.documents:
            # serve what `pc-rag encode --remote-store` (or another replica) stored: nothing to encode
            corpus = [Passage(r.name, r.text, dict(r.metadata)) for r in shared.documents.values()]
            names = [p.id for p in corpus]
            source = f"documents from {args.remote_store}"
        else:
            corpus = stdlib_corpus()
            names = self.engine.add_documents(
                [p.text for p in corpus], ids=[p.id for p in corpus], metadatas=[p.metadata for p in corpus], system=DEMO_SYSTEM,
                context=args.context, neighbours=args.neighbours,
            )
            source = "passages of standard-library documentation"
        try:
            self.retriever = FaissModuleRetriever.load(engine=self.engine)
            if sorted(self.retriever.names) != sorted(names):
                raise PromptCacheError("the saved index holds other documents")
        except PromptCacheError as reason:
            logger.info("building the index (%s)", reason)
            self.retriever = FaissModuleRetriever(engine=self.engine)
            self.retriever.add([p.text for p in corpus], ids=names, metadatas=[p.metadata for p in corpus], progress=False)
            self.retriever.save()
        tokens = sum(len(self.engine.schemas["docs"].layout.modules[n].token_ids) for n in names)
        print(f"corpus: {len(names)} {source}, {tokens} tokens, "
              f"ready in {time.perf_counter() - started:.1f} s (cache: {args.kv_dir})\n")
        self.k = args.k
        self.reorder = args.context is not None  # retrieved passages follow the neighbours they were encoded behind
        self.max_new_tokens = args.max_new_tokens

    def chain(self, use_cache: bool = True):  # noqa: ANN201 - a LangChain Runnable
        from langchain_core.prompts import ChatPromptTemplate
        from langchain_core.runnables import RunnablePassthrough

        from .integrations.langchain import ChatPromptCache, PromptCacheRetriever, format_modules

        retriever = PromptCacheRetriever(retriever=self.retriever, k=self.k, reorder=self.reorder)
        # a 135M instruct model loops without a repetition penalty; cached and full prefill use the same settings
        llm = ChatPromptCache(engine=self.engine, max_new_tokens=self.max_new_tokens, use_cache=use_cache,
                              repetition_penalty=DEMO_REPETITION_PENALTY, no_repeat_ngram_size=DEMO_NO_REPEAT_NGRAM, stop=DEMO_STOP)
        prompt = ChatPromptTemplate.from_messages(list(CHAT_TEMPLATE))
        return {"context": retriever | format_modules, "question": RunnablePassthrough()} | prompt | llm

    def answer(self, question: str, compare: bool) -> Agreement | None:
        """Print the cached answer; with ``compare``, full prefill's TTFT and how far their answers agree."""
        message = self.chain().invoke(question)
        meta = message.response_metadata
        print(f"Q: {question}\nA: {answer_text(message.content)}")
        print(f"   modules: {', '.join(meta['modules'])}")
        line = f"   TTFT cached {meta['ttft_s'] * 1000:.0f} ms ({meta['cached_tokens']} cached / {meta['computed_tokens']} computed tokens)"
        if not compare:
            print(line + "\n")
            return None
        full = self.chain(use_cache=False).invoke(question)
        agreement = Agreement.of(self.engine.tokenize(message.content), self.engine.tokenize(full.content),
                                 full.response_metadata["ttft_s"] / max(meta["ttft_s"], 1e-9))
        print(f"{line} | full prefill {full.response_metadata['ttft_s'] * 1000:.0f} ms | speedup {agreement.speedup:.1f}x")
        print(f"   against full prefill: first token {'agrees' if agreement.first else 'differs'}, "
              f"{agreement.leading} of {agreement.tokens} leading tokens equal\n")
        return agreement


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How far a cached answer follows full prefill's: a yes/no on whole answers hides it (a
    135M model's 30-100-token greedy answers part somewhere even when they start alike)."""

    first: bool  # the first tokens are equal
    leading: int  # tokens equal from the start
    tokens: int  # full prefill's answer's tokens
    speedup: float  # TTFT, full prefill over cached

    @classmethod
    def of(cls, cached: list[int], full: list[int], speedup: float) -> "Agreement":
        leading = next((i for i, (a, b) in enumerate(zip(cached, full)) if a != b), min(len(cached), len(full)))
        return cls(bool(cached) and bool(full) and cached[0] == full[0], leading, len(full), speedup)

    @staticmethod
    def totals(rows: list["Agreement"]) -> str:
        return (f"totals: first token agrees on {sum(r.first for r in rows)} of {len(rows)} questions; "
                f"{sum(r.leading for r in rows)} of {sum(r.tokens for r in rows)} leading tokens equal full prefill's; "
                f"speedup {statistics.median(r.speedup for r in rows):.1f}x (median)")


def answer_text(reply: str) -> str:
    """The reply as printed after "A: " (a reply that starts with its own "A:" or "Answer:" is not labelled twice)."""
    text = reply.strip()
    for label in ("A:", "Answer:"):
        if text.startswith(label):
            return text[len(label):].strip()
    return text
