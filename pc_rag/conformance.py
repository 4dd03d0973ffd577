"""``PromptCache.check()`` and ``pc-rag check MODEL``: a conformance self-test on a user's own checkpoint.

Two parts, both on the real weights:

1. **Exactness.** Each path pc-rag serves the model by, against what must equal it: a module read
   where it was encoded (cached against full prefill, logits and decode steps), every cached token
   recomputed (against full prefill), rows of a batch sharing a moved module and requests joining
   a running one (against the same requests alone), and each recovery strategy (runs, or is
   refused when the engine is built). A path passes within ``tolerance`` in logits. These run the C
   decode step on float32 inputs; where it rounds them to 16 bits (``weights="int4"`` on AVX512-VNNI)
   one more path measures that rounding against float inputs, within its own tolerance.
2. **Fidelity of moved modules**, the approximation Prompt Cache makes: on a small built-in RAG
   probe set (``data/conformance_probe.json``: 8 SQuAD questions, each over its paragraph placed
   second of three), first-token agreement and KL(full || cached) at the engine's own settings
   at pc-rag's default settings and at stronger recovery, and the cheapest setting that keeps
   agreement >= 7/8 and KL <= 0.05.

Every check runs on a helper engine over the same model object (the caller's engine is not
touched: no document is added to it), closed afterwards; the helpers share one temporary
``kv_dir``, so each probe passage is encoded once and loaded by the others.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from importlib import resources
from typing import Any

import torch

from .errors import PromptCacheError
from .prompt.documents import build_prompt
from .prompt.pml import PML, escape
from .weights.int4 import Int4Linear

logger = logging.getLogger(__name__)

TOLERANCE = 1e-3
# weights="int4" on torch's kernel multiplies bf16 activations (8 bits of mantissa), in kernels whose
# summation order follows the number of rows: the same logits differ by a few 1e-3 from one batch shape
# to another on an AVX2 CPU, and by up to 3.2e-2 on an AVX-512 BF16 one (a tiny Llama's module decoded
# in place, its prefill in float32 and its encoding in bf16), whose kernel rounds bf16 pairs itself
BF16_TOLERANCE = 5e-2
# the C decode step's inputs rounded to 16 bits a block (weights="int4" on AVX512-VNNI, a16_kernels.c): the
# rounding is a step function, so two paths whose KV differs by float rounding can round an input apart, a
# step of 2^-15 of its block's largest; the embedded model's paths then differed by 2.7-3.5e-3 in logits
A16_TOLERANCE = 1e-2
A16_PATH = "decode steps on 16-bit inputs"
EXACT = dict(recompute=0, recompute_tail=0, attention_temperature=1.0, attention_scale=1.0)
AGREEMENT_BAR, KL_BAR = 7 / 8, 0.05


@dataclass
class PathResult:
    """One exactness check: the largest |logit difference| it measured, or why it did not run."""

    path: str
    max_diff: float | None
    note: str = ""
    tolerance: float = TOLERANCE

    @property
    def passed(self) -> bool:
        if self.max_diff is None:  # refused when the engine is built: a clean refusal is conformant
            return bool(self.note)
        return self.max_diff <= self.tolerance


@dataclass
class FidelityResult:
    """Moved modules on the probe set under one setting, against full prefill of the same tokens."""

    setting: str
    agreement: float
    kl: float
    settings: dict[str, Any] = field(default_factory=dict)  # the engine's keyword arguments for it ({}: the defaults)

    @property
    def good(self) -> bool:
        return self.agreement >= AGREEMENT_BAR and self.kl <= KL_BAR


@dataclass
class CheckReport:
    """What :func:`check` measured, and its verdict (``str(report)`` prints it)."""

    model: str
    paths: list[PathResult] = field(default_factory=list)
    fidelity: list[FidelityResult] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return all(p.passed for p in self.paths)

    @property
    def recommended(self) -> str | None:
        """The cheapest setting whose fidelity meets the bar (None: none does)."""
        return next((f.setting for f in self.fidelity if f.good), None)

    def __str__(self) -> str:
        tolerance = min((p.tolerance for p in self.paths), default=TOLERANCE)
        lines = [f"pc-rag check: {self.model}", f"exactness (max |logit diff|, tolerance {tolerance:g}):"]
        for p in self.paths:
            measured = f"{p.max_diff:.2e}" if p.max_diff is not None else "-"
            note = p.note + (f" (tolerance {p.tolerance:g})" if p.tolerance != tolerance else "")
            lines.append(f"  {'ok  ' if p.passed else 'FAIL'} {p.path:<40} {measured:>9}  {note}".rstrip())
        lines.append("moved-module fidelity (8 RAG questions, against full prefill):")
        for f in self.fidelity:
            lines.append(f"  {f.setting:<44} first token = full {f.agreement:6.1%}   KL {f.kl:.4f}")
        verdict = "exact on every path it serves" if self.exact else "NOT exact on every path: do not serve it until fixed"
        advice = (f"recommended: {self.recommended}" if self.recommended else
                  "no setting tried keeps agreement >= 87.5% and KL <= 0.05: read moved documents as text (use_cache=False) where it matters")
        return "\n".join([*lines, f"verdict: {verdict}; {advice}"])


def check(engine: Any, *, fidelity: bool = True) -> CheckReport:
    """Run the exactness checks (and, with ``fidelity``, the probe set) on ``engine``'s model."""
    report = CheckReport(getattr(engine.model.config, "_name_or_path", "") or type(engine.model).__name__)
    probe = _probe_set()
    # the helper engines share one temporary kv_dir: each passage is encoded once, then loaded
    with tempfile.TemporaryDirectory(prefix="pc-rag-check-") as kv_dir:
        helpers = partial(_helper, engine, kv_dir)
        paths = _exactness(engine, helpers, probe[0])
        tolerance = BF16_TOLERANCE if any(isinstance(m, Int4Linear) for m in engine.model.modules()) else TOLERANCE
        report.paths = [replace(path, tolerance=max(tolerance, path.tolerance)) for path in paths]
        if fidelity and engine.movable:  # modules that cannot move are read where they were encoded: nothing to approximate
            report.fidelity = _fidelity(helpers, probe)
    return report


# -- exactness ------------------------------------------------------------------------------------
def _exactness(engine: Any, helpers: Helpers, item: dict[str, Any]) -> list[PathResult]:
    helper = helpers(**EXACT)
    try:
        prompts = _store(helper, item["passages"])
        lone: list[Any] = []  # the three prompts alone, generated once for the batch and the newcomers
        paths = [_safely(OWN_FORWARD, _own_forward, helper, prompts),
                 _safely("module in place, decode steps", _in_place, helper, prompts),
                 _safely("every token recomputed", _recomputed, helpers, item),
                 _safely(_batch_path(engine), _batch, helper, prompts, lone),
                 _safely("a request joining running ones", _joined, helper, prompts, lone)]
        if _input_bits(engine) == 16:  # the caller's engine: its helpers' steps are on float32 inputs
            paths.append(_safely(A16_PATH, _sixteen_bit_inputs, helper, prompts))
    finally:
        _close(helper)
    return paths + [_safely(f'recovery="{strategy}"', _strategy, helpers, strategy, item["passages"])
                    for strategy in ("head_tail", "query", "deviation")]


def _safely(path: str, run: Callable[..., PathResult], *args: Any) -> PathResult:
    """``run(*args)``, or a failed path saying what it raised (a path that raises is not exact)."""
    try:
        return run(*args)
    except Exception as err:  # noqa: BLE001 - what a path raises is what the check reports
        logger.warning("pc-rag check: %s raised %s: %s", path, type(err).__name__, err)
        return PathResult(path, float("inf"), f"raised {type(err).__name__}: {str(err)[:120]}")


def _in_place(engine: Any, prompts: PromptMaker) -> PathResult:
    """The first document is read where it was encoded: cached equals full prefill, steps included."""
    prompt = prompts("What is this passage about?", [0])
    cached = engine.generate(prompt, max_new_tokens=6, output_logits=True, do_sample=False)
    full = engine.generate(prompt, max_new_tokens=6, output_logits=True, do_sample=False, use_cache=False)
    if cached.token_ids != full.token_ids:
        return PathResult("module in place, decode steps", float("inf"), "tokens differ")
    return PathResult("module in place, decode steps", _diff([cached.logits], [full.logits]))


OWN_FORWARD = "full prefill = the model's own forward"


def _sixteen_bit_inputs(engine: Any, prompts: PromptMaker) -> PathResult:
    """The C decode step on the inputs it rounds to 16 bits against float32 inputs: the same tokens, the
    logits within A16_TOLERANCE."""
    prompt = prompts("What is this passage about?", [0])
    fused = _fused_step(engine)
    before = fused.activation_bits
    floats = engine.generate(prompt, max_new_tokens=6, output_logits=True, do_sample=False)
    fused.activation_bits = 16
    try:
        sixteen = engine.generate(prompt, max_new_tokens=6, output_logits=True, do_sample=False)
    finally:
        fused.activation_bits = before
    if sixteen.token_ids != floats.token_ids:
        return PathResult(A16_PATH, float("inf"), "tokens differ", tolerance=A16_TOLERANCE)
    return PathResult(A16_PATH, _diff([sixteen.logits], [floats.logits]), tolerance=A16_TOLERANCE)


def _own_forward(engine: Any, make: PromptMaker) -> PathResult:
    """pc-rag's full prefill (its buffers, masks and positions) against the model's own forward on
    the same tokens: what every other path is compared with must itself be right (BART's decoder
    places its positions by the length of its own cache, not by the positions it is given)."""
    prompt = make("Who is named?", [1, 0] if engine.movable else [0, 1, 2])
    ids = engine.plan(prompt).input_ids
    with torch.inference_mode():
        own = engine.model(input_ids=torch.tensor([ids], device=engine.model.device), use_cache=False).logits[0, -1]
    ours = engine.next_token_logits(prompt, use_cache=False)
    return PathResult(OWN_FORWARD, (ours.float() - own.float()).abs().max().item())


def _recomputed(helpers: Helpers, item: dict[str, Any]) -> PathResult:
    """Every cached token computed again: equals full prefill exactly."""
    try:
        helper = helpers(**{**EXACT, "recompute": 10**6, "recompute_tail": 10**6})
    except PromptCacheError as err:
        return PathResult("every token recomputed", None, f"refused when built ({err})")
    try:
        prompt = _store(helper, item["passages"])(item["question"], [1, 0, 2])
        return PathResult("every token recomputed", (helper.next_token_logits(prompt) - helper.next_token_logits(prompt, use_cache=False))
                          .abs().max().item())
    finally:
        _close(helper)


def _batch_path(engine: Any) -> str:
    return f"batch rows sharing a {'moved' if engine.movable else 'cached'} module"


def _lone(engine: Any, prompts: list[Any], lone: list[Any]) -> list[Any]:
    """``lone``, filled with each prompt generated alone if it is empty."""
    if not lone:
        lone.extend(engine.generate(p, max_new_tokens=4, output_logits=True, do_sample=False) for p in prompts)
    return lone


def _batch(engine: Any, make: PromptMaker, lone: list[Any] | None = None) -> PathResult:
    prompts = _prompts(make)
    lone = _lone(engine, prompts, [] if lone is None else lone)
    batch = engine.generate_batch(prompts, max_new_tokens=4, output_logits=True, do_sample=False)
    return PathResult(_batch_path(engine), _diff([r.logits for r in batch], [r.logits for r in lone]))


def _joined(engine: Any, make: PromptMaker, lone: list[Any]) -> PathResult:
    """Each request opened once the one before it has its first token: a newcomer fused into the running step."""
    prompts = _prompts(make)
    lone = _lone(engine, prompts, lone)
    streams = []
    for prompt in prompts:
        streams.append(engine.stream(prompt, max_new_tokens=4, output_logits=True, do_sample=False))
        next(streams[-1], None)
    for stream in streams:
        for _ in stream:
            pass
    return PathResult("a request joining running ones", _diff([s.result.logits for s in streams], [r.logits for r in lone]))


def _strategy(helpers: Helpers, strategy: str, passages: list[str]) -> PathResult:
    """Recovery by ``strategy``: its batch rows equal its lone requests, or the engine refuses it when built."""
    path = f'recovery="{strategy}"'
    try:
        helper = helpers(recovery=strategy, **({"recovery_budget": 0.2} if strategy != "head_tail" else {}))
    except PromptCacheError as err:
        return PathResult(path, None, f"refused when built ({err})")
    try:
        return PathResult(path, _batch(helper, _store(helper, passages)).max_diff)
    finally:
        _close(helper)


# -- fidelity -------------------------------------------------------------------------------------
def _fidelity(helpers: Helpers, probe: list[dict[str, Any]]) -> list[FidelityResult]:
    """The probe set at the defaults, with more tokens recomputed, and with scored recovery (where
    the model runs it); full prefill's logits are computed once for all three."""
    helper = helpers()
    try:
        prompts = [build_prompt(item["question"], helper.add_documents(item["passages"], progress=False)) for item in probe]
        full = [helper.next_token_logits(prompt, use_cache=False) for prompt in prompts]
        results = [_measure("defaults", helper, prompts, full, {})]
        helper.recompute, helper.recompute_tail = 32, 8
        results.append(_measure("recompute=32, recompute_tail=8", helper, prompts, full, {"recompute": 32, "recompute_tail": 8}))
    finally:
        _close(helper)
    label = 'recovery="query", recovery_budget=0.3'
    try:
        helper = helpers(recovery="query", recovery_budget=0.3)
    except PromptCacheError as err:
        logger.info("fidelity under %s not measured: %s", label, err)
        return results
    try:
        for item in probe:  # the same documents under the same names: the prompts above read them here
            helper.add_documents(item["passages"], progress=False)
        return [*results, _measure(label, helper, prompts, full, {"recovery": "query", "recovery_budget": 0.3})]
    finally:
        _close(helper)


def _measure(label: str, engine: Any, prompts: list[str], full: list[torch.Tensor], settings: dict[str, Any]) -> FidelityResult:
    agree, kls = 0, []
    for prompt, expected in zip(prompts, full):
        cached = engine.next_token_logits(prompt)
        agree += int(cached.argmax() == expected.argmax())
        kls.append(torch.nn.functional.kl_div(cached.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="sum").item())
    return FidelityResult(label, agree / len(prompts), sum(kls) / len(kls), settings)


# -- parts ----------------------------------------------------------------------------------------
def _probe_set() -> list[dict[str, Any]]:
    return json.loads(resources.files("pc_rag").joinpath("data/conformance_probe.json").read_text())["items"]


PromptMaker = Callable[[str, list[int]], Any]
Helpers = Callable[..., Any]  # settings -> another engine over the same model (see _helper)


def _store(engine: Any, passages: list[str]) -> PromptMaker:
    """Store ``passages`` in ``engine``; return ``make(question, order)``, the prompt importing them
    in that order. A model whose modules cannot move (learned positions, rotary pc-rag does not
    recognise) gets them as modules of a schema, imported in the schema's order."""
    if engine.movable:
        names = engine.add_documents(passages, progress=False)
        return lambda question, order: build_prompt(question, [names[i] for i in order])
    modules = "".join(f'<module name="p{i}">{escape(text)} </module>' for i, text in enumerate(passages))
    engine.add_schema(f'<schema name="conformance">{modules}</schema>', progress=False)
    return lambda question, order: PML('<prompt schema="conformance">' + "".join(f"<p{i}/>" for i in sorted(order))
                                       + f"<user>{escape(question)}</user></prompt>")


def _prompts(make: PromptMaker) -> list[Any]:
    """Three prompts over the same documents, the second moved to the front (a moved module)."""
    return [make(q, [1, 0]) for q in ("Who is named?", "What happened?", "When was it?")]


def _fused_step(engine: Any) -> Any:
    """``engine``'s C decode step (:class:`pc_rag.forward.fused_step.FusedStep`), or None where it has none."""
    step = engine.forward.written_step
    return None if step is None else step.fused


def _input_bits(engine: Any) -> int:
    """The bits ``engine``'s C decode step rounds its products' inputs to (32: float inputs, or no C step)."""
    fused = _fused_step(engine)
    return 32 if fused is None else fused.activation_bits


def _helper(engine: Any, kv_dir: str, **settings: Any) -> Any:
    """Another engine over the same model and tokenizer, with ``settings``, storing modules in ``kv_dir``;
    a C decode step on 16-bit inputs put on float32 ones (see the module's docstring)."""
    helper = type(engine)(engine.model, engine.tokenizer, kv_dir=kv_dir, **settings)
    if _input_bits(helper) == 16:
        _fused_step(helper).activation_bits = 32
    return helper


def _close(engine: Any) -> None:
    engine.scheduler.close(timeout=10.0)
    engine.background.close(timeout=10.0)


def _diff(first: list[Any], second: list[Any]) -> float:
    """The largest |difference| between two lists of per-step logits (lists of tensors)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = [(a, b) for x, y in zip(first, second) for a, b in zip(x, y)]
    return max(((a - b).abs().max().item() for a, b in pairs), default=0.0)

