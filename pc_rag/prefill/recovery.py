"""Recovery that chooses which cached tokens to recompute: ``deviation`` (CacheBlend) and ``query``.

A module encoded on its own never attended to the modules a prompt places before it; recovery
computes some of its tokens again, at serve time, behind everything that precedes them. Fixed
head and tail tokens (``head_tail``, :func:`recover`) need no model pass to
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
weight multiplied by a scale (:mod:`pc_rag.prefill.ape`).

Both strategies then run one forward pass over the chosen tokens and the prompt's own computed tokens
(:func:`pc_rag.prefill.scored.prefill_selected`); the stale cache entries of the chosen tokens are
masked out, never copied around. The scores come from the attention function
(:mod:`pc_rag.forward.attention`), which hands each layer's queries and keys to a :class:`Probe` passed
as a forward keyword, the way shared KV reaches it.

This module is where a request's recovery is decided: :func:`recover` (head and tail, at
planning, so a plan shows what it computes) and :func:`prefill_plans`, the one call the engine
makes to assemble and prefill a request, which applies APE and the scored strategies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from ..errors import PromptCacheError
from ..forward.attention import ATTENTION_NAME
from ..prompt.plan import Plan, PlanSource, Segment

if TYPE_CHECKING:
    from ..model.spec import ModelSpec

Strategy = Literal["head_tail", "deviation", "query"]
STRATEGIES: tuple[str, ...] = ("head_tail", "deviation", "query")
SCORED: tuple[str, ...] = ("deviation", "query")


# Recovery: tokens recomputed at the head (EPIC-style) and at the tail of every imported module
# that was not encoded behind exactly what precedes it (benchmarks/quality.py measured the choice;
# see docs/quality.md)
DEFAULT_RECOMPUTE = 2
DEFAULT_RECOMPUTE_TAIL = 1
DEFAULT_RECOVERY: Strategy = "head_tail"
# APE on top (RoPE models on sdpa/eager): computed queries read moved modules through a flatter
# (temperature 1.1), lighter (scale 0.7) attention; chosen with the recovery above, see docs/quality.md
DEFAULT_ATTENTION_TEMPERATURE = 1.1
DEFAULT_ATTENTION_SCALE = 0.7
# (head, tail) tokens per moved module when recompute=/recompute_tail= are not given, per strategy
DEFAULT_HEAD_TAIL: dict[str, tuple[int, int]] = {"head_tail": (DEFAULT_RECOMPUTE, DEFAULT_RECOMPUTE_TAIL),
                                                 "deviation": (0, 0), "query": (0, 0)}
DEFAULT_BUDGET: dict[str, float] = {"deviation": 0.1, "query": 0.1}

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


def configure_recovery(spec: "ModelSpec", *, strategy: Strategy | None, budget: float | int | None, recompute: int | None,  # noqa: PYI041
                       recompute_tail: int | None, temperature: float | None, scale: float | None) -> Recovery:
    """The engine's recovery from its arguments (None: the defaults above, where the model can
    take them); refuses what the model cannot run."""
    chosen = strategy or DEFAULT_RECOVERY
    if strategy is None and chosen in SCORED and not spec.split:
        chosen = "head_tail"  # scored recovery reads attention through pc_rag_sdpa; the default falls back
    check_recovery(chosen, budget, spec)
    defaults = (DEFAULT_ATTENTION_TEMPERATURE, DEFAULT_ATTENTION_SCALE) if spec.one_pass else (1.0, 1.0)
    temperature = defaults[0] if temperature is None else temperature
    scale = defaults[1] if scale is None else scale
    check_ape(temperature, scale, spec)
    head_default, tail_default = DEFAULT_HEAD_TAIL[chosen]
    return Recovery(
        chosen,  # type: ignore[arg-type]
        budget if budget is not None else DEFAULT_BUDGET.get(chosen, 0),
        recovery_tokens(recompute, "recompute", head_default, spec),
        recovery_tokens(recompute_tail, "recompute_tail", tail_default, spec),
        temperature=float(temperature),
        scale=float(scale),
    )


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
        has = (f"this one has {spec.position_kind} positions and {spec.attn_implementation!r} attention" if not spec.one_pass
               or spec.attn_implementation != ATTENTION_NAME else
               "this one's layers do not hand it pc-rag's keywords as they are (the reason was logged when the engine was built)")
        raise PromptCacheError(f"recovery={strategy!r} needs a RoPE model on sdpa attention (it reads attention through pc-rag's "
                               f"attention function); {has}")
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
# Head and tail: fixed tokens of every moved module, chosen without a model pass
# ---------------------------------------------------------------------------------------------
def recovery_tokens(requested: int | None, what: str, default: int, spec: "ModelSpec") -> int:
    """How many head (tail) tokens of each moved module to recompute: ``default`` where the model
    can take it (RoPE, one-pass prefill), else 0; an explicit request it cannot take is refused."""
    supported = spec.one_pass
    if requested is None:
        return default if supported else 0
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
        raise PromptCacheError(f"{what} must be a number of tokens >= 0, got {requested!r}")
    if requested and not supported:
        raise PromptCacheError(
            f"{what} needs a RoPE model on sdpa or eager attention; this one has {spec.position_kind} positions "
            f"and {spec.attn_implementation!r} attention (use {what}=0)"
        )
    return requested


def recover(planned: Plan, *, head: int, tail: int, encoding: str) -> Plan:
    """Compute the first ``head`` and the last ``tail`` tokens of every moved module instead of reusing them.

    A module encoded on its own never attended to the modules placed before it in this
    prompt. Its first tokens carry much of that loss (they also soak up attention as the start
    of a sequence): recomputing them behind everything that precedes them (EPIC,
    arXiv:2410.15332) restores cross-module attention for a few tokens per module. Its last
    token (for a document, the separator) has, in full prefill, read every module before it;
    encoded alone it read one. Recomputed, it carries the whole context to the tokens after
    it (on HotpotQA one tail token per document cut the first-token KL divergence from full
    prefill by a third, see docs/quality.md). The tail is the end of the stored module: a document
    quoted into plain text ends with its text, and the separator after it is computed anyway.

    Exact already, and left alone: a segment at the position it was encoded at, behind exactly
    the tokens it was encoded behind (:func:`encoded_behind`): the schema's prefix at the start
    of a prompt, and under ``shared_prefix`` encoding the first module after it (the first
    document of a ``build_prompt`` or chat prompt). The same prefix found anywhere else (a
    system turn quoted mid-conversation) has moved and is recovered like any module.
    """
    flags = moved(planned, encoding)
    if not head and not tail:
        return replace(planned, moved=tuple(flags))
    segments: list[Segment] = []
    recovered: list[bool] = []  # the flags of the recovered plan's segments
    for segment, is_moved in zip(planned.segments, flags):
        if not is_moved:
            segments.append(segment)
            recovered.append(False)
            continue
        schema = planned.sources[segment.schema]  # type: ignore[index]
        module = schema.layout.modules[segment.owner]  # type: ignore[index]
        module_end = segment.offset + len(segment) == len(module.token_ids)
        # the module's first `head` tokens (a drop-in document whose first token merged with the
        # text before it starts at offset 1: its head is the rest of them)
        first = min(max(head - segment.offset, 0), len(segment))
        last = min(tail, len(segment) - first) if module_end else 0
        kept = len(segment) - first - last
        if first:
            segments.append(Segment(segment.token_ids[:first], segment.position))
            recovered.append(False)
        if kept:
            segments.append(
                replace(segment, token_ids=segment.token_ids[first : first + kept], position=segment.position + first,
                        offset=segment.offset + first, source_position=segment.source_position + first)
            )
            recovered.append(True)
        if last:
            segments.append(Segment(segment.token_ids[first + kept :], segment.position + first + kept))
            recovered.append(False)
    return replace(planned, segments=segments, moved=tuple(recovered))


def moved(planned: Plan, encoding: str) -> list[bool]:
    """Per segment: a cached segment whose KV is not what full prefill computes here (recovery
    may recompute it). A segment at the position it was encoded at, behind exactly the tokens
    it was encoded behind (:func:`encoded_behind`), is exact and is not."""
    flags: list[bool] = []
    preceding: list[int] = []  # the prompt's tokens before the segment at hand
    for segment in planned.segments:
        before = len(preceding)
        preceding.extend(segment.token_ids)
        if not segment.cached:
            flags.append(False)
            continue
        exact = False
        if segment.position == segment.source_position:
            schema = planned.sources[segment.schema]  # type: ignore[index]
            context = encoded_behind(schema, segment.owner, segment.offset, encoding, plain=segment.plain)  # type: ignore[arg-type]
            exact = len(context) == before and preceding[:before] == context
        flags.append(not exact)
    return flags


def encoded_behind(schema: PlanSource, name: str, offset: int, encoding: str, *, plain: bool = False) -> list[int]:
    """The tokens that token ``offset`` of module ``name`` was encoded behind: the path before it
    (``scaffold``), else what the schema's modules are encoded behind (nothing for ``isolated``;
    the prefix and lead for ``shared_prefix``), a document's neighbour context (not in its
    ``plain`` variant), and the module's own tokens before it."""
    joint = schema.joint.get(name)
    if joint is not None:
        return list(joint.token_ids[: joint.index[offset]])
    layout = schema.layout
    module = layout.modules[name]
    before: list[int] = []
    if encoding != "isolated" and layout.prefix is not None and name != layout.prefix:
        before = list(layout.modules[layout.prefix].token_ids) + list(layout.lead)
    context = None if plain else schema.contexts.get(name)
    if context is not None:  # a document encoded behind its neighbours (pc_rag.prompt.neighbours)
        before += context.token_ids
    return before + list(module.token_ids[:offset])
