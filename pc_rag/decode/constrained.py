"""Constrained decoding: output that always matches a JSON schema, enforced token by token.

Built on llguidance (the grammar engine behind llama.cpp's and vLLM's structured output):
a request with ``json_schema=`` gets a matcher that says, before each token is chosen, which
tokens keep the output a valid prefix of some document of the schema; every other token's
logit is set to -inf, so greedy and sampled decoding alike can only write valid JSON, and the
end-of-turn token is allowed only once the document is complete.

Chosen by measurement (``benchmarks/structured_overhead.py``, docs/integrations.md "Structured output"):
llguidance and xgrammar cost the same here (~0.2-0.3 ms per token, under 0.5% of a decode step
of the embedded model on 2 CPU cores), and llguidance brings no dependencies where xgrammar
pulls in triton (~1 GB) for a CPU wheel.

The tokenizer's vocabulary is indexed once per engine (~0.7 s) and each schema compiled once
(a few ms, cached); a matcher per request is cheap.

A document always closes within the token budget when it can: before each token the matcher
checks that the document could still be completed in the tokens left after it (the *closing*: a
short completion found by walking the grammar, :meth:`Matcher.closing`); when it could not, the
first token of today's closing is taken instead. So the model writes freely while the budget
allows and is steered to close the document when it runs short; only a budget smaller than the
closing from the start leaves a document incomplete (finish_reason "length").
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import forks
from ..errors import PromptCacheError

# the closing walk's candidates (those that are one token of the vocabulary, bare and after a
# space), in its order of preference among equals: what ends a string, array or object; the
# separators (which also end a number: "1.5" would otherwise grow "1.50000..."); the shortest
# values; what opens one; a letter for a string that must be longer
_CLOSING_TEXTS = ('"}', '"]', "}}", "]}", '"', "}", "]", ",", ":", '""', "0", "[]", "{}", "null", "true", "false",
                  "1", "{", "[", "a")
# a closing longer than this is not looked for (the document is left to the model and the budget)
_MAX_CLOSING = 512

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
        forks.renew_after_fork(self, "_lock")
        self._built: Any = None
        self._closing_order: tuple[list[int], list[bytes], torch.Tensor] | None = None
        # bit i of word w allows token 32*w + i: the shifts that unpack a word, made once
        self._bits = torch.arange(32, dtype=torch.int32)

    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._built is None:
                import llguidance.hf

                self._built = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size, eos_token=self._stops or None)
            return self._built

    def closing_order(self) -> tuple[list[int], list[bytes], torch.Tensor]:
        """What the closing walk needs, built once: the candidate tokens (:data:`_CLOSING_TEXTS`
        that are single tokens, bare and after a space), every token's bytes, and every token's
        length in bytes (special tokens: longest)."""
        tokenizer = self._lltokenizer()
        with self._lock:
            if self._closing_order is None:
                candidates = []
                for text in (*_CLOSING_TEXTS, *(" " + text for text in _CLOSING_TEXTS)):
                    ids = tokenizer.tokenize_str(text)
                    if len(ids) == 1 and ids[0] not in candidates:
                        candidates.append(ids[0])
                token_bytes = [tokenizer.decode_bytes([i]) for i in range(self._vocab_size)]
                lengths = torch.tensor([len(b) or 1 << 20 for b in token_bytes])
                for special in self._stops:
                    if special < self._vocab_size:
                        lengths[special] = 1 << 20
                self._closing_order = (candidates, token_bytes, lengths)
            return self._closing_order

    def allowed(self, words: torch.Tensor) -> torch.Tensor:
        """llguidance bitmask rows (int32 words, ``[rows, words]``) as a bool per token id, ``[rows, tokens]``."""
        return ((words[..., None] >> self._bits.to(words.device)) & 1).flatten(-2).bool()

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
        self.vocabulary = vocabulary
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._plan: list[int] | None = None  # the closing from the current state, once walked
        self._nesting = Nesting()
        self._bytes = vocabulary.closing_order()[1]  # every token's bytes (built once per vocabulary)
        self._walked: tuple[int, list[int]] | None = None
        self._out_of_reach = False  # no closing fits the budget: the document is left to the model

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write what the grammar allows now into row ``row`` of an llguidance ``bitmask`` (host)."""
        self._fill(self._matcher, bitmask, row)

    def accept(self, token: int) -> None:
        if self._plan and self._plan[0] == token:
            self._plan = self._plan[1:]  # still the closing from the new state: the same walk
        elif self._walked is not None and self._walked[0] == token:
            self._plan = self._walked[1]  # walked by within() from the state after this token
        else:
            self._plan = None
        self._walked = None
        if not self._matcher.consume_token(token):
            raise PromptCacheError(f"token {token} does not continue the JSON schema's grammar: {self._matcher.get_error()}")
        self._nesting = self._nesting.feed(self._token_bytes(token))

    @property
    def complete(self) -> bool:
        """The document is whole (the end of turn is allowed)."""
        return bool(self._matcher.is_accepting())

    def closing(self, limit: int = _MAX_CLOSING) -> list[int] | None:
        """Tokens that complete the document from here (none when it is whole), or None when the
        walk needs more than ``limit`` (see :func:`_walk`). Short, not always the shortest."""
        if self._plan is None and not self._out_of_reach:
            self._plan = _walk(self._matcher.deep_copy(), self._nesting, self._vocabulary, _MAX_CLOSING)
            self._out_of_reach = self._plan is None
        return self._plan if self._plan is not None and len(self._plan) <= limit else None

    def within(self, token: int, remaining: int) -> int:
        """``token`` when the document can still close in the ``remaining - 1`` tokens after it,
        else the first token of the closing from here. A budget that cannot hold the closing
        from the start is left alone: the document ends incomplete (finish_reason "length")."""
        if self._out_of_reach:
            return token
        plan = self.closing(remaining)
        if plan is None:
            # the budget cannot hold even the closing from here (only so from the start: the checks
            # keep it so after): the document is left to the model, and ends incomplete unless it closes
            self._out_of_reach = True
            return token
        if not plan or token == plan[0]:
            return token
        after = self._matcher.deep_copy()
        after.consume_token(token)
        if len(plan) < remaining:
            # most tokens (a word inside a string) leave today's closing a closing: one check, no walk
            probe = after.deep_copy()
            if probe.validate_tokens(plan) == len(plan) and probe.consume_tokens(plan) and probe.is_accepting():
                self._walked = (token, plan)
                return token
        walked = _walk(after, self._nesting.feed(self._token_bytes(token)), self._vocabulary, remaining - 1)
        if walked is None:
            return plan[0]
        self._walked = (token, walked)  # the next step's closing, if the token is taken
        return token

    def _token_bytes(self, token: int) -> bytes:
        return self._bytes[token] if token < len(self._bytes) else b""


def allowed_tokens(matchers: Sequence[Matcher | None], vocab: int, device: torch.device,
                   on_error: Callable[[int, Exception], None]) -> torch.Tensor:
    """What each row may write next, ``[rows, vocab]`` bool on ``device``: its grammar's allowed
    tokens (every token for a row without a grammar). The grammars fill one bitmask on the host,
    which crosses to the device in one transfer for the whole batch; logit rows padded past the
    tokenizer's vocabulary are never allowed to a grammar.

    ``on_error(row, error)``: a grammar that raises is reported there (its row allows every
    token, and its request fails alone)."""
    import llguidance.torch

    vocabulary = next(m.vocabulary for m in matchers if m is not None)
    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocabulary._vocab_size)
    for row, matcher in enumerate(matchers):
        if matcher is None:
            bitmask[row] = -1  # every bit set
        else:
            try:
                matcher.fill(bitmask, row)
            except Exception as err:  # noqa: BLE001 - one row's grammar fails its request alone
                on_error(row, err)
                bitmask[row] = -1
    allowed = vocabulary.allowed(bitmask.to(device))
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        allowed[[row for row, m in enumerate(matchers) if m is None], vocabulary._vocab_size :] = True
    return allowed[:, :vocab]


@dataclass(frozen=True)
class Nesting:
    """How deep a JSON text is open: what the closing walk measures its progress by."""

    depth: int = 0  # open objects and arrays
    in_string: bool = False
    escaped: bool = False  # a backslash inside a string, its escape not yet read

    def feed(self, data: bytes) -> Nesting:
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for byte in data:
            if escaped:
                escaped = False
            elif in_string:
                escaped, in_string = byte == 0x5C, byte != 0x22
            elif byte == 0x22:
                in_string = True
            elif byte in (0x7B, 0x5B):
                depth += 1
            elif byte in (0x7D, 0x5D):
                depth -= 1
        return Nesting(depth, in_string, escaped)

    @property
    def open(self) -> int:
        """Open containers and strings: each needs at least one more byte to close."""
        return self.depth + self.in_string + self.escaped


def _walk(matcher: Any, nesting: Nesting, vocabulary: Vocabulary, limit: int) -> list[int] | None:
    """A closing of ``matcher``'s document (consumed as it goes), or None past ``limit`` tokens.

    Each step takes the tokens the grammar forces, else of the candidate tokens the grammar
    allows the one that leaves the fewest containers and strings open (the first listed in
    :data:`_CLOSING_TEXTS` among equals), else the shortest token it allows."""
    import llguidance.torch

    candidates, token_bytes, lengths = vocabulary.closing_order()
    plan: list[int] = []
    bitmask = None
    while not matcher.is_accepting():
        if len(plan) >= limit or matcher.is_error():
            return None
        forced = matcher.compute_ff_tokens()[: limit - len(plan)]
        if not forced:
            best: tuple[int, int] | None = None
            for token in candidates:
                if matcher.validate_tokens([token]) == 1:
                    left_open = nesting.feed(token_bytes[token]).open
                    if best is None or left_open < best[0]:
                        best = (left_open, token)
            if best is None:
                if bitmask is None:
                    bitmask = llguidance.torch.allocate_token_bitmask(1, vocabulary._vocab_size)
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
                allowed = vocabulary.allowed(bitmask[0])[: lengths.numel()]
                if not bool(allowed.any()):
                    return None
                best = (0, int(torch.where(allowed, lengths, 1 << 30).argmin()))
            forced = [best[1]]
        if not matcher.consume_tokens(forced):
            return None
        plan.extend(forced)
        for token in forced:
            nesting = nesting.feed(token_bytes[token])
    return plan
