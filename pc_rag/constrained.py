"""Constrained decoding: output that always matches a JSON schema, enforced token by token.

Built on llguidance (the grammar engine behind llama.cpp's and vLLM's structured output):
a request with ``json_schema=`` gets a matcher that says, before each token is chosen, which
tokens keep the output a valid prefix of some document of the schema; every other token's
logit is set to -inf, so greedy and sampled decoding alike can only write valid JSON, and the
end-of-turn token is allowed only once the document is complete.

Chosen by measurement (``benchmarks/structured_overhead.py``, README "Structured output"):
llguidance and xgrammar cost the same here (~0.2-0.3 ms per token, under 0.5% of a decode step
of the embedded model on 2 CPU cores), and llguidance brings no dependencies where xgrammar
pulls in triton (~1 GB) for a CPU wheel.

The tokenizer's vocabulary is indexed once per engine (~0.7 s) and each schema compiled once
(a few ms, cached); a matcher per request is cheap.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping
from typing import Any

import torch

from .errors import PromptCacheError

# JSON as ``json.dumps`` writes it: one space after separators and no free whitespace, so a small
# model cannot wander into unbounded runs of spaces and newlines between values
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_text(schema: Mapping[str, Any] | str | bool) -> str:
    """A JSON schema (a dict, its JSON text, or ``True`` for any JSON object) as JSON text.

    Raises :class:`PromptCacheError` for text that is not JSON or a schema llguidance cannot compile.
    """
    if schema is True:
        schema = {"type": "object"}
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise PromptCacheError(f"json_schema is not valid JSON: {err}") from err
    if not isinstance(schema, Mapping):
        raise PromptCacheError(f"json_schema must be a dict (a JSON schema), its JSON text or True, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, ensure_ascii=False)  # key order kept: properties are written in it
    except (TypeError, ValueError) as err:
        raise PromptCacheError(f"json_schema is not JSON-serialisable: {err}") from err
    _grammar(text)  # refuse a schema that cannot be compiled before any work
    return text


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing of others closed to
    them (``additionalProperties: false``), as OpenAI's strict mode reads a schema: without it a
    constrained model may add keys the schema never named."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=256)
def _grammar(schema: str) -> str:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_STYLE)
    except Exception as err:  # llguidance raises plain ValueError/RuntimeError: re-raised typed
        raise PromptCacheError(f"json_schema cannot be compiled: {err}") from err
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise PromptCacheError(f"json_schema cannot be compiled: {error}")
    return grammar


class Vocabulary:
    """The tokenizer as llguidance sees it (built once per engine, on first use: ~0.7 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._tokenizer, self._vocab_size, self._stops = tokenizer, vocab_size, sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._built: Any = None
        # bit i of word w allows token 32*w + i: the shifts that unpack a word, made once
        self._bits = torch.arange(32, dtype=torch.int32)

    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._built is None:
                import llguidance.hf

                self._built = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size, eos_token=self._stops or None)
            return self._built

    def matcher(self, schema: str) -> Matcher:
        """A fresh matcher for one request's output."""
        return Matcher(self, schema)


class Matcher:
    """One request's position in the grammar: masks logits, then advances by the chosen token."""

    def __init__(self, vocabulary: Vocabulary, schema: str) -> None:
        import llguidance
        import llguidance.torch

        self._vocabulary = vocabulary
        self._matcher = llguidance.LLMatcher(vocabulary._lltokenizer(), _grammar(schema))
        if self._matcher.is_error():
            raise PromptCacheError(f"json_schema cannot be compiled: {self._matcher.get_error()}")
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocabulary._vocab_size)
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._forbidden: torch.Tensor | None = None  # this step's mask, computed on first use

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (one row) with every token the grammar forbids now at -inf (a new tensor)."""
        if self._forbidden is None:  # once per step, however many rows of scores are masked
            self._fill(self._matcher, self._bitmask)
            words = self._bitmask[0].to(logits.device)
            allowed = ((words[:, None] >> self._vocabulary._bits.to(logits.device)) & 1).flatten()
            vocab = logits.shape[-1]
            if allowed.numel() < vocab:  # logit rows padded past the tokenizer: never allowed
                allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.numel()))
            self._forbidden = allowed[:vocab] == 0
        return logits.float().masked_fill(self._forbidden, float("-inf"))

    def accept(self, token: int) -> None:
        self._forbidden = None
        if not self._matcher.consume_token(token):
            raise PromptCacheError(f"token {token} does not continue the JSON schema's grammar: {self._matcher.get_error()}")
