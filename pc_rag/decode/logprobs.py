"""Log-probabilities of generated tokens: taken on the decode loop from each step's raw logits
(``logprobs=k`` of :meth:`pc_rag.PromptCache.generate`), and shaped as OpenAI's APIs return them
(the server's replies, the LangChain chat model's ``response_metadata["logprobs"]``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model (its raw logits, before temperature,
    processors and grammar: what vLLM returns by default), and the ``top`` most likely tokens at
    that step as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under one row's raw ``logits`` [vocab], and the ``top`` most
    likely tokens' (one softmax and one transfer of 2 * (top + 1) numbers)."""
    scores = torch.log_softmax(logits.float(), -1)
    if not top:
        return TokenLogprob(token, float(scores[token]))
    values, ids = scores.topk(top)
    picked = torch.cat([scores[token].reshape(1), values]).tolist()
    return TokenLogprob(token, picked[0], list(zip(ids.tolist(), picked[1:])))


class LoggedPiece(str):
    """A streamed piece of text that also carries ``logprobs``: the entries of the tokens whose
    text it completes (a stream asked for log-probabilities yields these; they are str everywhere)."""

    logprobs: list[TokenLogprob]

    def __new__(cls, text: str, logprobs: list[TokenLogprob]) -> "LoggedPiece":
        piece = super().__new__(cls, text)
        piece.logprobs = logprobs
        return piece

    def __reduce__(self) -> tuple[Any, ...]:  # crosses to a Ray replica's caller whole
        return LoggedPiece, (str(self), self.logprobs)


class PieceAligner:
    """Hands each streamed piece the log-probabilities of the tokens it completes: a token is
    complete once all its text has been handed out (text held back, an unfinished character or
    the possible start of a stop sequence, holds its tokens back too). Tokens never shown (cut
    by a stop sequence) are left for the stream's end: ``entries[sent:]``."""

    def __init__(self, entries: list[TokenLogprob]) -> None:
        self.entries = entries  # grows as the request decodes: one per generated token
        self.ends: list[int] = []  # each token's end in the decoded text, once its text is released
        self.unended = 0
        self.shown = 0  # characters handed out
        self.sent = 0  # entries handed out

    def decoded(self, released: int, grew: bool) -> None:
        """A token was added; the detokeniser has ``released`` characters (``grew``: just now)."""
        self.unended += 1
        if grew:
            self.settle(released)

    def settle(self, released: int) -> None:
        """The tokens added so far end at ``released`` characters (their text has been released)."""
        self.ends.extend([released] * self.unended)
        self.unended = 0

    def piece(self, text: str) -> str:
        """``text`` (handed out now) with the entries it completes."""
        self.shown += len(text)
        start = self.sent
        while self.sent < len(self.ends) and self.ends[self.sent] <= self.shown:
            self.sent += 1
        return LoggedPiece(text, self.entries[start : self.sent]) if text else text


def token_texts(entries: Sequence[TokenLogprob], tokenizer: Any) -> dict[int, str]:
    """Each token id ``entries`` name, as its text (decoded alone, as vLLM names them: a token
    holding part of a character reads as U+FFFD)."""
    ids = {entry.token_id for entry in entries} | {i for entry in entries for i, _ in entry.top}
    return {i: tokenizer.decode([i]) for i in ids}


def chat_logprobs(entries: Sequence[TokenLogprob] | None, tokenizer: Any) -> dict[str, Any] | None:
    """OpenAI's ``choices[].logprobs`` of a chat completion (``Generation.logprobs``, one entry
    per generated token); None when none were asked for."""
    if entries is None:
        return None
    text = token_texts(entries, tokenizer)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": text[token_id], "logprob": logprob, "bytes": list(text[token_id].encode())}

    return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob] | None, tokenizer: Any, offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions' ``choices[].logprobs``: tokens, their log-probabilities, the
    alternatives as {token: log-probability} and each token's character offset in the text (the
    first at ``offset``: a streamed chunk's tokens continue the text before it)."""
    if entries is None:
        return None
    text = token_texts(entries, tokenizer)
    tokens = [text[e.token_id] for e in entries]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text[i]: lp for i, lp in e.top} for e in entries], "text_offset": offsets}
