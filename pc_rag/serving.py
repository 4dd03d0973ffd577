"""The serving half of :class:`pc_rag.PromptCache`'s public API, and the request it runs:

    plan (planner.plan, recovery.recover) -> admit -> Scheduler.submit
        -> [the scheduler's loop] pipeline.prefill_plans -> loop.RunningBatch (with other callers' rows)

Each request is planned on the caller's thread against an immutable registry snapshot and
refused there, before any work, when it cannot be served; the scheduler
(:mod:`pc_rag.scheduler`) runs every forward pass, batching concurrent callers; a request
finishes on the KV it was planned with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import torch

from . import planner
from .background import BackgroundEncoder
from .callers import AsyncStream, StreamingGeneration, Ticket, wait
from .decode.constrained import Vocabulary
from .decode.request import Generation, RequestState
from .decode.sampling import SamplingParams, sampling_params
from .errors import ContextWindowExceeded, PromptCacheError
from .forward.forward import Forward
from .kv.buffers import BufferPool
from .kv.load_or_compute import CostModel, compute_in_prompt, load_or_compute, short_prefixes
from .kv.remote import RemoteTier
from .kv.store import ModuleStore
from .model.spec import ModelSpec
from .prefill import calibration, pipeline
from .prefill import recovery as recovery_mod
from .prefill.assemble import Assembled, Assembler, Assembly, Held
from .prefill.encode import ModuleEncoder
from .prefill.recovery import Recovery
from .prefill.rows import Prefilled
from .prompt.chat import render_chat
from .prompt.plan import Plan
from .prompt.recurring import RecurringPassages
from .registry import Registry
from .scheduler import Scheduler
from .warm_up import WarmUp, warm_up

logger = logging.getLogger(__name__)


class Serving:
    """Mixed into :class:`pc_rag.PromptCache`, which builds the parts named here."""

    model: Any
    tokenizer: Any
    spec: ModelSpec
    encoding: str
    drop_in: bool
    passages: RecurringPassages | None
    recovery: Recovery
    assembly: Assembly
    registry: Registry
    store: ModuleStore
    remote: RemoteTier | None
    forward: Forward
    encoder: ModuleEncoder
    assembler: Assembler
    buffers: BufferPool
    background: BackgroundEncoder
    stop_token_ids: set[int]
    generation_config: Any
    _vocabularies: dict[frozenset[int], Vocabulary]
    _kv_bytes_per_token: int
    costs: CostModel
    scheduler: Scheduler

    @property
    def _shares(self) -> bool:
        """Whether batched rows read the module KV they import alike once, shared (split
        attention), rather than each from its own copy. Not when decode steps are compiled: a
        step that reads shared parts runs eagerly, and every RAG batch shares at least the
        schema's system prompt, so a compiled engine would otherwise never run its compiled step
        for more than one caller."""
        return self.spec.split and not self.forward.compiled

    # -- serving ------------------------------------------------------------------------------------
    def plan(self, prompt: str, *, collections: str | Sequence[str] | None = None) -> Plan:
        """Which tokens of ``prompt`` are cached and which computed, at which positions.

        ``collections``: the collections (document schemas and PML schemas) this request may
        read; None (the default) is all of them, for single-user use. A scoped request imports,
        matches (drop-in) and names nothing outside them: see :func:`pc_rag.planner.plan`.
        """
        planned = planner.plan(prompt, self.registry.snapshot(), self.spec, encoding=self.encoding, drop_in=self.drop_in,
                               collections=self._with_learned(planner.scope(collections)))
        return recovery_mod.recover(planned, head=self.recovery.head, tail=self.recovery.tail, encoding=self.encoding)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """``[{"role", "content"}]`` as the model's chat template renders them, ending with the generation prompt.

        ``tools``: OpenAI-style function specs, rendered by the template when it takes tools and
        otherwise described in the system turn (see :mod:`pc_rag.prompt.tools`); assistant messages may
        carry ``tool_calls`` and ``tool`` messages the results.

        The result is a plain prompt: module references and verbatim document text inside the
        messages are reused like anywhere else; nothing in a message is read as PML.
        """
        return render_chat(self.tokenizer, self.spec.markers, messages, tools)

    def next_token_logits(self, prompt: str, *, use_cache: bool = True, collections: str | Sequence[str] | None = None) -> torch.Tensor:
        """Logits of the first generated token: the quantity cached inference must reproduce."""
        plans = self._prepare([prompt], use_cache, planner.scope(collections))
        return _finish(self._run(plans, SamplingParams(max_new_tokens=0), use_cache, time.perf_counter(), share=False, logits_only=True))

    def generate(self, prompt: str, *, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, stop: str | Sequence[str] | None = None,
                 use_cache: bool = True, seed: int | None = None, collections: str | Sequence[str] | None = None,
                 **generation: Any) -> Generation:
        """Generate a completion; ``use_cache=False`` runs full prefill of the same token sequence.

        ``collections`` scopes the request to those collections (see :meth:`plan`; None: all).

        ``generation`` takes transformers' names, with its meaning: ``do_sample``,
        ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ``stop_strings``,
        ``output_logits``, ``generation_config`` (a ``transformers.GenerationConfig`` or a dict);
        ``max_tokens``, OpenAI's bound on the reply with OpenAI's meaning: a prompt that leaves less
        room in the context window is refused (``ContextWindowExceeded``) before anything is queued,
        where ``max_new_tokens`` stops the reply at the window;
        and ``json_schema`` (a JSON schema dict, its text, or True for any JSON object): the
        output is constrained, token by token, to a document of that schema (:mod:`pc_rag.decode.constrained`),
        closed within ``max_new_tokens`` whenever that can hold one (:meth:`min_json_tokens`), and
        not cut by stop strings. What a call leaves unset comes from ``generation_config``, then from the engine's
        :attr:`generation_config` (the model's own: its sampling defaults apply when it sets
        ``do_sample=True``), then from pc-rag's defaults (greedy, 256 new tokens). A ``temperature``
        given without ``do_sample`` decides alone: 0 is greedy, more samples.
        """
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             stop=stop, use_cache=use_cache, seed=seed, collections=collections, **generation)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str, *, max_new_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, stop: str | Sequence[str] | None = None,
               use_cache: bool = True, seed: int | None = None, collections: str | Sequence[str] | None = None,
               **generation: Any) -> StreamingGeneration:
        """Like :meth:`generate`, yielding text as it is decoded; ``.result`` holds the Generation.

        The prompt is planned (and refused, if it cannot be served) now; it is prefilled on the
        first ``next()``, on the KV it was planned with.
        """
        started = time.perf_counter()
        params = _checked(sampling_params(dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                               stop=stop, seed=seed, **generation), self.generation_config), self.model)
        plans = self._prepare([prompt], use_cache, planner.scope(collections))
        # share: admitted with other callers' rows, it shares the module KV they import alike (not
        # when decode steps are compiled: see _shares)
        return StreamingGeneration(self._run(plans, params, use_cache, started, share=self._shares))

    async def agenerate(self, prompt: str, **kwargs: Any) -> Generation:
        """:meth:`generate` for asyncio (the same keywords): the event loop never waits on a
        forward pass, and cancelling the awaiting task frees the request's row at the
        scheduler's next step."""
        stream = self.astream(prompt, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    def astream(self, prompt: str, *, max_new_tokens: int | None = None, temperature: float | None = None,
                top_p: float | None = None, top_k: int | None = None, stop: str | Sequence[str] | None = None,
                use_cache: bool = True, seed: int | None = None, collections: str | Sequence[str] | None = None,
                **generation: Any) -> AsyncStream:
        """:meth:`stream` for asyncio: ``async for piece in engine.astream(prompt)``; ``.result``
        holds the Generation once exhausted. Bad arguments are refused now; the prompt is planned
        (and refused, if it cannot be served) on a worker thread at the first ``__anext__``."""
        started = time.perf_counter()
        params = _checked(sampling_params(dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                               stop=stop, seed=seed, **generation), self.generation_config), self.model)
        scope = planner.scope(collections)

        def start() -> Ticket:
            return self._ticket(self._prepare([prompt], use_cache, scope), params, use_cache, started, share=self._shares)

        return AsyncStream(self.scheduler, start)

    def generate_batch(self, prompts: Sequence[str], *, max_new_tokens: int | None = None, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None, stop: str | Sequence[str] | None = None,
                       use_cache: bool = True, seed: int | None = None, share_modules: bool | None = None,
                       collections: str | Sequence[str] | None = None, **generation: Any) -> list[Generation]:
        """Generate completions for several prompts together: one forward pass per step for all.

        Every prompt is planned first, so every error surfaces before any work. With
        ``share_modules`` (RoPE models on SDPA), cached KV that several prompts import at the same
        positions is held once and attended to once per step for all of them (shared-module
        attention, see :mod:`pc_rag.forward.shared_attention`); what each prompt computes is prefilled in
        one batched pass (None: unless the engine compiles its decode steps, see ``compile``).
        Greedy outputs equal those of :meth:`generate` called on each prompt.
        Models whose attention cannot take per-row masks (ALiBi, learned positions, flash/flex
        attention) are served one prompt after another. ``collections`` scopes every prompt
        (see :meth:`plan`); rows share only KV they may all read.
        """
        if isinstance(prompts, str):
            raise PromptCacheError("generate_batch takes a sequence of prompts; use generate() for one")
        prompts = list(prompts)
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed)
        params = _checked(sampling_params({**kwargs, **generation}, self.generation_config), self.model)  # bad arguments fail first
        scope = planner.scope(collections)
        if len(prompts) <= 1:
            return [self.generate(p, use_cache=use_cache, collections=scope, **kwargs, **generation) for p in prompts]  # type: ignore[arg-type]
        started = time.perf_counter()
        plans = self._prepare(prompts, use_cache, scope)
        if not self.spec.one_pass:  # one prompt after another, each its own request (planned above, all first)
            return [_finish(self._run([plan], params, use_cache, started, share=False)) for plan in plans]
        share = self._shares if share_modules is None else share_modules and self.spec.split
        return _finish(self._run(plans, params, use_cache, started, share=share))

    def warm_up(self, *, new_tokens: int = 3) -> WarmUp:
        """Compile (under ``compile="reduce-overhead"`` on a GPU: record as CUDA graphs) the decode
        step for the batch sizes the scheduler serves, with a few throwaway requests, so that no
        caller waits for a compilation (:mod:`pc_rag.warm_up`). Eagerly: one short request."""
        return warm_up(self, new_tokens=new_tokens)

    def check(self, *, fidelity: bool = True) -> Any:
        """A conformance self-test of this engine's model (``pc-rag check``; :mod:`pc_rag.conformance`):
        every path pc-rag serves it by against what must equal it, on the real weights, then (with
        ``fidelity``) moved-module fidelity on a built-in RAG probe set at the default and stronger
        recovery settings. Returns a :class:`~pc_rag.conformance.CheckReport`; ``print`` it for the
        verdict and the settings it recommends, which are kept in ``kv_dir`` for engines over the same
        model that choose no recovery setting (:mod:`pc_rag.prefill.calibration`)."""
        from .conformance import check

        report = check(self, fidelity=fidelity)
        calibration.keep(self.kv_dir, self.spec.fingerprint, report)
        return report

    def min_json_tokens(self, json_schema: Any) -> int | None:
        """Tokens of the shortest document of ``json_schema`` that constrained decoding closes a
        reply with (its closing walk from an empty reply: short, not always the shortest); None
        when none is within 512 tokens. A ``max_new_tokens`` below it ends incomplete."""
        from .decode.constrained import schema_text

        closing = self._vocabulary.matcher(schema_text(json_schema)).closing()
        return None if closing is None else len(closing)

    # -- the chain -----------------------------------------------------------------------------
    @property
    def _vocabulary(self) -> Vocabulary:
        """The tokenizer indexed for constrained decoding, ending documents with today's stop tokens."""
        stops = frozenset(self.stop_token_ids)
        vocabulary = self._vocabularies.get(stops)
        if vocabulary is None:
            vocabulary = self._vocabularies[stops] = Vocabulary(self.tokenizer, self.model.config.vocab_size, stops)
        return vocabulary

    def _prepare(self, prompts: Sequence[str], use_cache: bool, collections: frozenset[str] | None = None) -> list[Plan]:
        """Plan every prompt and refuse, before any work, what cannot be served."""
        if not isinstance(use_cache, bool):  # "no" would read as True
            raise PromptCacheError(f"use_cache must be True or False, got {use_cache!r}")
        self.sync_if_due()
        plans = []
        for index, prompt in enumerate(prompts):
            try:
                try:
                    plans.append(self.plan(prompt, collections=collections))
                except PromptCacheError:
                    # a module another replica added since this one started: take the registry in, plan again
                    if self.remote is None or not self.sync_documents():
                        raise
                    plans.append(self.plan(prompt, collections=collections))
            except PromptCacheError as err:
                if len(prompts) > 1:
                    raise PromptCacheError(f"prompt {index}: {err}") from err
                raise
        planner.admit(plans, self.spec, use_cache=use_cache, memory_budget=self.store.memory_budget,
                      kv_bytes_per_token=self._kv_bytes_per_token)
        if use_cache and self.passages is not None:
            for prompt in prompts:
                self._learn_from(prompt, collections)
        if use_cache and (self.store.disk is not None or self.remote is not None):
            # modules not in memory: loaded concurrently, or computed in the prompt where their
            # tier is slower than prefill (pc_rag.kv.load_or_compute)
            plans, load, deadline = load_or_compute(plans, self.store, self.costs, self._kv_bytes_per_token)
            late = self.encoder.prefetch(plans, load, deadline)
            plans = compute_in_prompt(plans, late, self.costs)  # a tier not measured yet lost the race
        if use_cache:  # per plan: a prefix short in one prompt may be most of another's cache
            plans = [compute_in_prompt([plan], short_prefixes([plan]), None)[0] for plan in plans]
        return plans

    # the scheduler's two calls into this engine's prefill path (pc_rag.prefill.pipeline)
    def _prefill(self, plans: list[Plan], new_tokens: int, use_cache: bool, share: bool, held: Held | None = None) -> Prefilled:
        return pipeline.prefill_plans(plans, new_tokens, use_cache=use_cache, share=share, recovery=self.recovery,
                                      encoding=self.encoding, assembler=self.assembler, assembly=self.assembly,
                                      forward=self.forward, spec=self.spec, buffers=self.buffers, held=held)

    def _assemble_plain(self, plans: list[Plan], new_tokens: int, use_cache: bool, share: bool,
                        held: Held | None = None) -> tuple[Assembled, float] | None:
        return pipeline.assemble_plain(plans, new_tokens, use_cache=use_cache, share=share, recovery=self.recovery,
                                       encoding=self.encoding, assembler=self.assembler, assembly=self.assembly, spec=self.spec,
                                       held=held)

    def _run(self, plans: list[Plan], params: SamplingParams, use_cache: bool, started: float, *, share: bool,
             logits_only: bool = False) -> Generator[str, None, Any]:
        """Submit ``plans`` to the scheduler on the first ``next()`` and wait for them: yields the
        text of a single request as it is decoded, and returns its Generation (a list of them for
        a batch; the first-token logits with ``logits_only``). Closing the generator early
        cancels the request: its rows stop at the scheduler's next step."""
        ticket = self._ticket(plans, params, use_cache, started, share=share, logits_only=logits_only)
        self.scheduler.submit(ticket)
        result = yield from wait(ticket, self.scheduler.cancel)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("store after request: %s", {"encoded": self.forward.encoded, **self.store.stats(scan_disk=False)})
        return result

    def _ticket(self, plans: list[Plan], params: SamplingParams, use_cache: bool, started: float, *, share: bool,
                logits_only: bool = False) -> Ticket:
        """What the scheduler serves: ``plans`` with a request state each (sampling, stops, statistics)."""
        window = self.spec.context_window
        for index, plan in enumerate(plans if params.fits_window and window is not None else ()):
            if plan.end + params.max_new_tokens > window:  # refused before it is queued, as OpenAI and vLLM refuse it
                which = f"prompt {index} needs" if len(plans) > 1 else "the prompt needs"
                raise ContextWindowExceeded(f"{which} {plan.end} positions and max_tokens {params.max_new_tokens} more: "
                                            f"{plan.end + params.max_new_tokens}, past the model's context window ({window})",
                                            param="max_tokens")
        requests = [
            RequestState(params=params, tokenizer=self.tokenizer, device=self.spec.device, stop_token_ids=frozenset(self.stop_token_ids),
                         context_window=self.spec.context_window, modules=list(p.modules),
                         cached_tokens=p.cached_tokens if use_cache else 0,
                         computed_tokens=p.computed_tokens if use_cache else len(p.input_ids), next_position=p.end, started=started,
                         prompt_ids=p.input_ids if params.reads_history else (),
                         matcher=self._vocabulary.matcher(params.json_schema) if params.json_schema else None)
            for p in plans
        ]
        return Ticket(plans, requests, use_cache=use_cache, share=share, submitted=time.perf_counter(), logits_only=logits_only)


def _checked(params: SamplingParams, model: Any) -> SamplingParams:
    """``params`` once what only the model can tell is checked too, before anything is queued."""
    vocabulary = model.config.get_text_config(decoder=True).vocab_size
    if params.logit_bias and params.logit_bias[-1][0] >= vocabulary:
        raise PromptCacheError(f"logit_bias names token {params.logit_bias[-1][0]}; the model's vocabulary has {vocabulary} tokens",
                               param="logit_bias")
    return params


def _finish(run: Generator[str, None, Any]) -> Any:
    """What ``run`` (a :meth:`Serving._run`) returns, its text pieces passed over."""
    try:
        while True:
            next(run)
    except StopIteration as done:
        return done.value
