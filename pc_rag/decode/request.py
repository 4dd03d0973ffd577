"""Per-request decoding state: incremental detokenisation, stop sequences, statistics, result types.

What a request asks for (sampling settings, their checks, the sampler and logits processors) is
:mod:`pc_rag.decode.sampling`'s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .logprobs import PieceAligner, TokenLogprob, token_logprob
from .sampling import Sampler, SamplingParams, TokenHistory


@dataclass
class CacheStats:
    """What one call reused and what it cost.

    ``ttft_s`` runs from receiving the prompt to having the first generated token;
    ``assemble_s`` is the part of it spent before the first forward pass (parsing, planning,
    gathering module KV); ``queue_s`` the part spent waiting for the scheduler to admit it
    (other requests filling its rows or budgets).
    """

    cached_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    modules: list[str] = field(default_factory=list)
    generated_tokens: int = 0
    assemble_s: float = 0.0
    prefill_s: float = 0.0
    queue_s: float = 0.0
    # set by a Ray Serve replica (pc_rag.server.replicas): which one served the call, and its
    # cumulative memory/disk/remote tier hits at the time
    replica: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        extra = {"replica": dict(self.replica)} if self.replica is not None else {}
        return {**extra, 
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "modules": list(self.modules),
            "generated_tokens": self.generated_tokens,
            "assemble_s": self.assemble_s,
            "prefill_s": self.prefill_s,
            "queue_s": self.queue_s,
        }


@dataclass
class Generation:
    text: str
    stats: CacheStats
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (end of turn or stop sequence) or "length"
    logits: list[torch.Tensor] | None = None  # with output_logits=True: each step's logits [vocab], on the CPU
    logprobs: list[TokenLogprob] | None = None  # with logprobs=k: one per token of token_ids


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that are safe to show.

    Decoding tokens one by one breaks multi-byte characters and merged pieces; instead the text
    of a short window of recent tokens is decoded and only its stable growth is released (a
    trailing U+FFFD means a character is still incomplete).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.released = 0  # characters handed out so far

    def add(self, token: int) -> str:
        self.tokens.append(token)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        text = decode(self.tokens[self.prefix_offset :], skip_special_tokens=True)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            delta = text[len(prefix) :]
            self.released += len(delta)
            return delta
        return ""

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        rest = text[self.released :]
        self.released = len(text)
        return rest


class StopFilter:
    """Holds back text that may be the start of a stop sequence; cuts the text at the first stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        if not self.stops:
            return delta
        self.pending += delta
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i != -1]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class RequestState:
    """One request's decoding state: sampling, detokenising, stop handling and statistics.

    Fed one row of logits per step by the decode loop (:mod:`pc_rag.prefill.passes`), whatever the
    batch; it decides the next token, what text that releases, and when the request is done.
    """

    def __init__(
        self,
        *,
        params: SamplingParams,
        tokenizer: Any,
        device: torch.device,
        stop_token_ids: frozenset[int],
        context_window: int | None,
        modules: list[str],
        cached_tokens: int,
        computed_tokens: int,
        next_position: int,
        started: float,
        prompt_ids: Sequence[int] = (),
        matcher: Any = None,
    ) -> None:
        self.stop_token_ids = stop_token_ids
        self.started = started
        self.next_position = next_position
        self.budget = params.max_new_tokens
        if context_window is not None:
            self.budget = min(self.budget, context_window - next_position)
        self.stats = CacheStats(modules=list(modules), cached_tokens=cached_tokens, computed_tokens=computed_tokens)
        self.greedy = params.temperature == 0
        self.sampler = Sampler(params, device)
        # processors read the prompt and what was generated (input ids, as in transformers; the
        # decode loop keeps them in a TokenHistory)
        self.processors = params.processors(len(prompt_ids), stop_token_ids)
        self.prompt_ids = list(prompt_ids) if self.processors is not None else []
        self.matcher = matcher  # constrained decoding (pc_rag.decode.constrained.Matcher), or None
        self.detok = IncrementalDetokenizer(tokenizer)
        # stop strings do not cut a constrained document: it ends when it is whole
        self.stops = StopFilter(() if matcher is not None else params.stop)
        self.pieces: list[str] = []
        self.finish = "length"
        self.steps = 0
        self.logits: list[torch.Tensor] | None = [] if params.output_logits else None
        self.top_logprobs = params.logprobs
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.aligner = PieceAligner(self.logprobs) if self.logprobs is not None else None  # streamed pieces carry theirs
        self.done = self.budget <= 0
        self.error: Exception | None = None  # what failed this request alone (see fail)
        self.prefill_started = time.perf_counter()
        # whose row this is: (the submission, its index in it), set by pc_rag.callers.Ticket; the
        # scheduler reads a row's caller from the request the batch holds there, wherever it moved
        self.owner: tuple[Any, int] | None = None

    def fail(self, error: Exception) -> None:
        """This request stops with ``error`` (its processors, grammar, sampler or detokeniser
        raised): it alone fails, the rows decoding beside it go on."""
        self.error, self.done = error, True

    def scores(self, logits: torch.Tensor, history: TokenHistory | None, row: int) -> torch.Tensor:
        """One row of ``logits`` after this request's logits processors (reading its ``history``
        row), on the device; ``logits`` itself when it has none."""
        if self.processors is None or history is None:
            return logits
        return self.processors(history.view(row), logits[None].float())[0]

    def take(self, token: int, logits: torch.Tensor | None = None) -> tuple[int | None, str]:
        """Record the chosen ``token`` (chosen on the device by the decode loop: processors, the
        grammar's mask, then greedy choice or sampling, transformers' order); return the token to
        feed next (None once done) and the new text. Under a grammar, a token after which the
        document could not close within the budget gives way to the closing (so the fed token
        may differ from ``token``)."""
        if self.matcher is not None:
            # near the end of the budget, a token after which the document could not close gives
            # way to the closing (pc_rag.decode.constrained): a constrained reply parses whenever it can
            token = self.matcher.within(token, self.budget - self.steps)
            self.matcher.accept(token)
        if self.steps == 0:
            now = time.perf_counter()
            self.stats.ttft_s = now - self.started
            self.stats.prefill_s = now - self.prefill_started
        if self.logits is not None and logits is not None:
            self.logits.append(logits.detach().float().cpu())
        self.steps += 1
        if token in self.stop_token_ids:
            self.finish, self.done = "stop", True
            return None, ""
        self.stats.generated_tokens += 1
        if self.logprobs is not None and logits is not None:
            self.logprobs.append(token_logprob(logits, token, self.top_logprobs or 0))
        text = self.detok.add(token)
        if self.aligner is not None:
            self.aligner.decoded(self.detok.released, bool(text))
        delta = self.stops.feed(text)
        if delta:
            self.pieces.append(delta)
            if self.aligner is not None:
                delta = self.aligner.piece(delta)
        if self.stops.stopped:
            self.finish, self.done = "stop", True
        elif self.steps >= self.budget:
            self.done = True
            if self.matcher is not None and self.matcher.complete:
                self.finish = "stop"  # the document closed on the budget's last token: it is whole
        return (None if self.done else token), delta

    def close(self) -> tuple[str, Generation]:
        """The text still held back (flushed now) and the finished Generation."""
        tail = ""
        if not self.stops.stopped:
            rest = self.detok.finish()
            if self.aligner is not None:
                self.aligner.settle(self.detok.released)
            tail = self.stops.feed(rest) + self.stops.flush()
            if tail:
                self.pieces.append(tail)
                if self.aligner is not None:
                    tail = self.aligner.piece(tail)
        self.stats.total_s = time.perf_counter() - self.started
        return tail, Generation("".join(self.pieces), self.stats, list(self.detok.tokens), self.finish, self.logits,
                                self.logprobs)
