"""Recovery that chooses which cached tokens to recompute: ``deviation`` (CacheBlend) and ``query``.

A module encoded on its own never attended to the modules a prompt places before it; recovery
computes some of its tokens again, at serve time, behind everything that precedes them. Fixed
head and tail tokens (``head_tail``, :func:`pc_rag.planner.recover`) need no model pass to
choose. The two strategies here score every moved cached token with a short pass of the model
and recompute the best ``budget`` of them:

- ``deviation`` (CacheBlend, arXiv:2405.16444): the whole prompt runs through the first
  ``check_layer + 1`` layers (an early exit: nothing after that layer's attention runs), the keys
  that pass computes at ``check_layer`` are compared with the cached keys (rotated to the
  prompt's positions), and the tokens whose keys deviate most are recomputed. Those first layers
  were computed for every token anyway: their exact KV replaces the cached KV of every token.
- ``query`` (A3, arXiv:2511.17560; ProphetKV, arXiv:2602.02579): the prompt's computed tokens
  (the question) run over the assembled cache through the first ``query_layers`` layers, and the
  cached tokens they attend to most (attention probability summed over heads, queries and
  layers) are recomputed: the context the answer reads is made exact.

APE's attention adjustment (arXiv:2502.05431) stacks on any strategy and costs nothing: the
logits of computed queries over the moved cached tokens are divided by a temperature and their
weight multiplied by a scale (:func:`pc_rag.generate.adjust_attention`).

Both strategies then run one forward pass over the chosen tokens and the prompt's own computed tokens
(:func:`pc_rag.generate.prefill_selected`); the stale cache entries of the chosen tokens are
masked out, never copied around. The scores come from the attention function
(:mod:`pc_rag.attention`), which hands each layer's queries and keys to a :class:`Probe` passed
as a forward keyword, the way shared KV reaches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .errors import PromptCacheError
from .layout import Plan

Strategy = Literal["head_tail", "deviation", "query"]
STRATEGIES: tuple[str, ...] = ("head_tail", "deviation", "query")
SCORED: tuple[str, ...] = ("deviation", "query")
PROBE_KWARG = "pc_rag_probe"


@dataclass(frozen=True)
class Recovery:
    """How a request recovers cross-module attention (see :class:`pc_rag.engine.PromptCache`)."""

    strategy: Strategy = "head_tail"
    budget: float | int = 0  # tokens chosen by the strategy: a fraction of the moved tokens (float) or a count (int)
    head: int = 0  # first tokens of every moved module, recomputed whatever the strategy
    tail: int = 0  # last tokens of every moved module
    check_layer: int = 1  # deviation: the layer whose keys are compared (layer 0's keys never deviate)
    query_layers: int | None = None  # query: layers whose attention is read (None: a third of them, at least 2)
    temperature: float = 1.0  # APE: logits of computed queries over moved cached tokens are divided by it
    scale: float = 1.0  # APE: and those tokens' attention weighted by it

    @property
    def scored(self) -> bool:
        return self.strategy in SCORED and self.budget != 0

    @property
    def adjusts_attention(self) -> bool:
        return self.temperature != 1.0 or self.scale != 1.0

    def count(self, candidates: int) -> int:
        """How many of ``candidates`` moved tokens the strategy recomputes."""
        if isinstance(self.budget, float):
            return min(candidates, round(self.budget * candidates))
        return min(candidates, self.budget)


def check_ape(temperature: Any, scale: Any, spec: Any) -> None:
    """APE's attention temperature and scale: positive numbers, on a model whose mask takes a bias."""
    for name, value in (("attention_temperature", temperature), ("attention_scale", scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise PromptCacheError(f"{name} must be a number > 0, got {value!r}")
    if (temperature != 1 or scale != 1) and not spec.one_pass:
        raise PromptCacheError(f"attention_temperature/attention_scale need a RoPE model on sdpa or eager attention; this one "
                               f"has {spec.position_kind} positions and {spec.attn_implementation!r} attention")


def check_recovery(strategy: Any, budget: Any, spec: Any) -> None:
    """Refuse an unknown strategy, a malformed budget, or a scored strategy the model cannot run."""
    if strategy not in STRATEGIES:
        raise PromptCacheError(f"unknown recovery {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy in SCORED and budget != 0 and not spec.split:
        raise PromptCacheError(
            f"recovery={strategy!r} needs a RoPE model on sdpa attention (it reads attention through pc-rag's "
            f"attention function); this one has {spec.position_kind} positions and {spec.attn_implementation!r} attention"
        )
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise PromptCacheError(f"recovery_budget must be a fraction (float in [0, 1]) or a token count (int >= 0), got {budget!r}")
    if isinstance(budget, float) and not 0.0 <= budget <= 1.0:
        raise PromptCacheError(f"recovery_budget as a fraction must lie in [0, 1], got {budget!r}")
    if isinstance(budget, int) and budget < 0:
        raise PromptCacheError(f"recovery_budget as a token count must be >= 0, got {budget!r}")
    if strategy == "head_tail" and budget:
        raise PromptCacheError("recovery='head_tail' is set by recompute= (head tokens) and recompute_tail= (tail "
                               "tokens) per module; recovery_budget is for 'deviation' and 'query'")


# ---------------------------------------------------------------------------------------------
# The probe: what the attention function reports, and the early exit
# ---------------------------------------------------------------------------------------------
class ProbeDone(Exception):
    """Raised by the attention function after the probe's last layer: the rest of the model is not run."""


class Probe:
    """Reads a forward pass layer by layer from inside the attention function.

    ``stop_after``: the last layer to run (its KV is written before its attention runs, so the
    cache holds it). ``query_weight [rows, q]`` (the real, not padded, queries): when given,
    every layer's attention probabilities from those queries are summed over heads and queries
    into ``scores [rows, keys]``.
    """

    def __init__(self, stop_after: int, query_weight: torch.Tensor | None = None) -> None:
        self.stop_after = stop_after
        self.query_weight = query_weight
        self.scores: torch.Tensor | None = None
        self._calls = 0

    def observe(self, module: Any, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> None:
        layer = getattr(module, "layer_idx", None)
        layer = self._calls if layer is None else layer
        self._calls += 1
        if self.query_weight is not None:
            self._score(query, key, mask, scaling)
        if layer >= self.stop_after:
            raise ProbeDone

    def _score(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> None:
        rows, heads, q, dim = query.shape
        kv_heads, keys = key.shape[1], key.shape[2]
        groups = heads // kv_heads
        scale = scaling if scaling is not None else dim**-0.5
        # grouped queries against their shared key head, no repeated keys: [rows, kv_heads, groups*q, keys]
        logits = torch.matmul(query.reshape(rows, kv_heads, groups * q, dim).float(), key.float().transpose(-1, -2)) * scale
        logits = logits.view(rows, kv_heads, groups, q, keys)
        if mask is None and q > 1:  # transformers' causal case: the queries are the last q keys
            causal = torch.ones(q, keys, dtype=torch.bool, device=logits.device).tril(keys - q)
            logits = logits.masked_fill(~causal, float("-inf"))
        elif mask is not None:
            if mask.dtype == torch.bool:
                logits = logits.masked_fill(~mask[:, :, None, :, :keys], float("-inf"))
            else:
                logits = logits + mask[:, :, None, :, :keys].float()
        probs = logits.softmax(-1)
        weight = self.query_weight.to(probs.device, probs.dtype)  # type: ignore[union-attr]
        scores = torch.einsum("rhgqk,rq->rk", probs, weight)
        self.scores = scores if self.scores is None else self.scores + scores


# ---------------------------------------------------------------------------------------------
# Which entries of a request's cache may be recomputed
# ---------------------------------------------------------------------------------------------
@dataclass
class Entries:
    """The cached entries of every row of a copy-assembled request, in cache order."""

    token_ids: torch.Tensor  # [rows, width] int64: the token of each entry
    candidate: torch.Tensor  # [rows, width] bool: a moved cached token (recovery may recompute it)
    lengths: list[int]  # real entries per row


def entries(plans: Sequence[Plan], moved: Sequence[Sequence[bool]], order: Sequence[int]) -> Entries:
    """Entries of rows assembled by copy: every cached segment of a row's plan, in plan order."""
    rows = [[(s, flag) for s, flag in zip(plans[i].segments, moved[i]) if s.cached] for i in order]
    candidate = moved_entries([[s for s, _ in row] for row in rows], [[f for _, f in row] for row in rows])
    ids = torch.zeros(candidate.shape, dtype=torch.long)
    for row, pairs in enumerate(rows):
        tokens = [t for s, _ in pairs for t in s.token_ids]
        if tokens:
            ids[row, : len(tokens)] = torch.tensor(tokens)
    return Entries(ids, candidate, [sum(len(s) for s, _ in pairs) for pairs in rows])


def moved_entries(segments: Sequence[Sequence[Any]], moved: Sequence[Sequence[bool]]) -> torch.Tensor:
    """``[rows, width]`` bool: per row, every entry of its cached ``segments`` (in cache order)
    flagged as its segment's ``moved`` flag."""
    width = max((sum(len(s) for s in row) for row in segments), default=0)
    flags = torch.zeros(len(segments), width, dtype=torch.bool)
    for row, (row_segments, row_moved) in enumerate(zip(segments, moved)):
        per_entry = [m for s, m in zip(row_segments, row_moved) for _ in range(len(s))]
        if per_entry:
            flags[row, : len(per_entry)] = torch.tensor(per_entry)
    return flags


def top_entries(scores: torch.Tensor, found: Entries, recovery: Recovery) -> list[torch.Tensor]:
    """Each row's chosen entries (indices into its cache, ascending): the best-scored candidates."""
    chosen = []
    width = found.candidate.shape[1]
    scores = scores[:, :width].float().cpu().masked_fill(~found.candidate, float("-inf"))
    for row in range(scores.shape[0]):
        count = recovery.count(int(found.candidate[row].sum()))
        picked = scores[row].topk(count).indices if count else torch.zeros(0, dtype=torch.long)
        chosen.append(picked.sort().values)
    return chosen


def query_layers(recovery: Recovery, layers: int) -> int:
    """How many layers the question's attention is read from."""
    wanted = recovery.query_layers if recovery.query_layers is not None else max(2, layers // 3)
    return max(1, min(layers, wanted))


def deviation(probe_keys: torch.Tensor, cached_keys: torch.Tensor) -> torch.Tensor:
    """Squared distance between recomputed and cached keys per token: ``[heads, n, dim]`` x2 -> ``[n]``."""
    return (probe_keys.float() - cached_keys.float()).pow(2).sum(dim=(0, 2))
