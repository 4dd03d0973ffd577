"""What a request asks for, checked, and how its next token is drawn: :class:`SamplingParams`
(from a call's keywords and the model's generation config: :func:`sampling_params`), the
:class:`Sampler`, the logits processors the settings build, and the token history they read.

Every setting is checked where the call is made, before anything is queued: a bad one is a
:class:`~pc_rag.errors.PromptCacheError` naming it (the server's 400 names the parameter).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PromptCacheError
from .logprobs import MAX_TOP_LOGPROBS

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
# every stop sequence is searched for after every token, on the scheduler's loop, which steps every
# caller's rows: unbounded, one request's stops would slow all of them (100,000 stops of 8
# characters, a 1 MB request body, took 300 ms per token). TGI bounds them too (4 by default).
MAX_STOP_SEQUENCES, MAX_STOP_CHARS = 16, 256


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """An int or float (numpy's included), not a bool, not NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _stop_sequences(stop: Any) -> tuple[str, ...]:
    """``stop`` (a string, a list of them, or None) as a tuple, checked against the bounds."""
    if stop is not None and not isinstance(stop, (str, Sequence)):
        raise PromptCacheError(f"stop must be a string or a list of strings, got {type(stop).__name__}", param="stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_SEQUENCES:
        raise PromptCacheError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}", param="stop")
    if any(not isinstance(s, str) or not s for s in stops):
        raise PromptCacheError(f"stop sequences must be non-empty strings, got {stop!r}", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        longest = max(stops, key=len)
        raise PromptCacheError(f"a stop sequence is at most {MAX_STOP_CHARS} characters, got one of {len(longest)}: {longest[:40]!r}...",
                               param="stop")
    return stops


def _check_processor_settings(repetition_penalty: Any, presence_penalty: Any, frequency_penalty: Any,
                              no_repeat_ngram_size: Any, min_new_tokens: Any) -> None:
    """The logits processors' settings, each typed and in its range (else a PromptCacheError naming it)."""
    if not _is_real(repetition_penalty) or not 0 < repetition_penalty < math.inf:
        raise PromptCacheError(f"repetition_penalty must be a finite number > 0, got {repetition_penalty!r}", param="repetition_penalty")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _is_real(value) or not -2 <= value <= 2:
            raise PromptCacheError(f"{name} must be a number from -2 to 2 (OpenAI's range), got {value!r}", param=name)
    for name, value in (("no_repeat_ngram_size", no_repeat_ngram_size), ("min_new_tokens", min_new_tokens)):
        if not _is_int(value) or value < 0:
            raise PromptCacheError(f"{name} must be an integer >= 0, got {value!r}", param=name)


def _schema(json_schema: Any) -> str | None:
    """The canonical text of ``json_schema`` (a dict, its text, or True for any JSON object); None: unconstrained."""
    if json_schema is None or json_schema is False:
        return None
    from .constrained import schema_text

    return schema_text(json_schema)


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` ({token id: bias from -100 to 100}; ids as JSON gives them, strings
    of digits, or ints) as sorted pairs; the ids' range is checked against the model's vocabulary
    when the request is submitted."""
    if bias is None:
        return ()
    if not isinstance(bias, Mapping):
        raise PromptCacheError(f"logit_bias must map token ids to biases, got {type(bias).__name__}", param="logit_bias")
    pairs = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_int(token) or token < 0:
            raise PromptCacheError(f"logit_bias keys are token ids (integers >= 0), got {key!r}", param="logit_bias")
        if not _is_real(value) or not -100 <= value <= 100:
            raise PromptCacheError(f"logit_bias of token {token} must be a number from -100 to 100, got {value!r}", param="logit_bias")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # transformers' logits processors, applied as its generate() applies them
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    output_logits: bool = False  # keep every step's raw logits (Generation.logits), as transformers' output_logits
    json_schema: str | None = None  # canonical schema text: output constrained to it (pc_rag.decode.constrained)
    logprobs: int | None = None  # each token's log-probability and this many alternatives (Generation.logprobs)
    # OpenAI's penalties on the tokens generated so far (the prompt's not counted), as vLLM applies them
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits, as OpenAI's logit_bias
    # given as OpenAI's max_tokens: a prompt that leaves less room in the context window is refused up
    # front (as OpenAI and vLLM refuse it), where transformers' max_new_tokens is cut at the window
    fits_window: bool = False

    @classmethod
    def build(
        cls,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        *,
        do_sample: bool | None = None,
        repetition_penalty: float = 1.0,
        no_repeat_ngram_size: int = 0,
        min_new_tokens: int = 0,
        stop_strings: str | Sequence[str] | None = None,
        output_logits: bool = False,
        json_schema: Any = None,
        logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[Any, float] | None = None,
        fits_window: bool = False,
    ) -> "SamplingParams":
        """Validated parameters. ``do_sample`` as in transformers: False is greedy whatever the
        temperature, True samples (at temperature 1.0 when none is given); ``stop_strings`` is
        transformers' name for ``stop``; ``output_logits`` keeps each step's logits, before any
        processor, in ``Generation.logits``; ``json_schema`` (a JSON schema dict, its text, or
        True for any JSON object) constrains the output to documents of that schema; ``logprobs``
        (vLLM's meaning: 0 to 20) records each generated token's log-probability and that many
        most likely alternatives in ``Generation.logprobs``; ``presence_penalty`` and
        ``frequency_penalty`` (OpenAI's, -2 to 2) lower each token's logit by the first once it has
        been generated and by the second for each time it has; ``logit_bias`` ({token id: -100
        to 100}, OpenAI's) is added to those tokens' logits."""
        # every check types its value first: a string or a NaN that slipped through would fail the
        # scheduler's step, and with it every row sharing that step, not just this call
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise PromptCacheError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}", param="max_new_tokens")
        if not _is_real(temperature) or not 0 <= temperature < math.inf:
            raise PromptCacheError(f"temperature must be a finite number >= 0, got {temperature!r}", param="temperature")
        if not _is_real(top_p) or not 0 < top_p <= 1:
            raise PromptCacheError(f"top_p must be in (0, 1], got {top_p!r}", param="top_p")
        if top_k is not None and (not _is_int(top_k) or top_k < 1):
            raise PromptCacheError(f"top_k must be a positive integer or None, got {top_k!r}", param="top_k")
        if seed is not None and (not _is_int(seed) or not SEED_MIN <= seed <= SEED_MAX):
            raise PromptCacheError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (torch's generator), got {seed!r}", param="seed")
        if stop is not None and stop_strings is not None:
            raise PromptCacheError("give stop or stop_strings (the same thing), not both", param="stop")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise PromptCacheError(f"do_sample must be True, False or None, got {do_sample!r}", param="do_sample")
        if do_sample is not None:
            temperature = (temperature or 1.0) if do_sample else 0.0
        _check_processor_settings(repetition_penalty, presence_penalty, frequency_penalty, no_repeat_ngram_size, min_new_tokens)
        stops = _stop_sequences(stop if stop is not None else stop_strings)
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise PromptCacheError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (alternatives per token) or None, got {logprobs!r}",
                                   param="logprobs")
        return cls(max_new_tokens, float(temperature), float(top_p), top_k, stops, seed,
                   float(repetition_penalty), no_repeat_ngram_size, min_new_tokens, bool(output_logits), _schema(json_schema), logprobs,
                   float(presence_penalty), float(frequency_penalty), _logit_bias(logit_bias), bool(fits_window))

    @property
    def reads_history(self) -> bool:
        """Whether a processor reads the prompt's and the generated tokens."""
        return (self.repetition_penalty != 1.0 or bool(self.no_repeat_ngram_size) or bool(self.min_new_tokens)
                or bool(self.presence_penalty) or bool(self.frequency_penalty) or bool(self.logit_bias))

    def processors(self, prompt_tokens: int, stop_token_ids: frozenset[int]) -> Any:
        """transformers' logits processors for these parameters, in its generate()'s order (None: none)."""
        from transformers import (
            LogitsProcessorList,
            MinNewTokensLengthLogitsProcessor,
            NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
        )

        if not self.reads_history:
            return None
        processors = LogitsProcessorList()
        if self.logit_bias:
            processors.append(LogitBias(self.logit_bias))
        if self.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.presence_penalty or self.frequency_penalty:
            processors.append(GeneratedTokenPenalties(prompt_tokens, self.presence_penalty, self.frequency_penalty))
        if self.no_repeat_ngram_size:
            processors.append(NoRepeatNGramLogitsProcessor(self.no_repeat_ngram_size))
        if self.min_new_tokens and stop_token_ids:
            processors.append(MinNewTokensLengthLogitsProcessor(prompt_tokens, self.min_new_tokens, sorted(stop_token_ids)))
        return processors or None


GENERATION_ARGUMENTS = ("do_sample", "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "stop_strings",
                        "output_logits", "generation_config", "json_schema", "logprobs", "presence_penalty", "frequency_penalty",
                        "logit_bias", "max_tokens")
# what a GenerationConfig contributes besides its sampling settings (taken when it sets do_sample=True)
_CONFIG_SETTINGS = ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "max_new_tokens", "stop_strings")


def from_generation_config(config: Any) -> dict[str, Any]:
    """The settings a ``GenerationConfig`` (or a dict of its fields) sets away from transformers' defaults."""
    from transformers import GenerationConfig

    if config is None:
        return {}
    if isinstance(config, Mapping):
        config = GenerationConfig(**config)
    if not isinstance(config, GenerationConfig):
        raise PromptCacheError(f"generation_config must be a transformers.GenerationConfig or a dict, got {type(config).__name__}")
    # fields a config leaves unset (None) take transformers' defaults, as its generate() does
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                "min_new_tokens": 0, "max_new_tokens": None, "stop_strings": None}
    settings = {name: getattr(config, name) for name in _CONFIG_SETTINGS
                if getattr(config, name, None) is not None and getattr(config, name) != defaults[name]}
    if config.do_sample:
        settings["do_sample"] = True
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(config, name, None)
            settings[name] = value if value is not None else defaults[name]
    return settings


def sampling_params(call: dict[str, Any], engine_config: Any = None) -> SamplingParams:
    """A call's settings over its ``generation_config`` over the engine's (``engine_config``), over
    pc-rag's defaults: transformers' precedence, with an explicit temperature deciding alone."""
    unknown = sorted(set(call) - set(GENERATION_ARGUMENTS) - {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed"})
    if unknown:
        raise PromptCacheError(f"unknown generation arguments: {', '.join(unknown)} (known besides the named ones: "
                               f"{', '.join(GENERATION_ARGUMENTS)})")
    given = {name: value for name, value in call.items() if value is not None and name != "generation_config"}
    settings = {**from_generation_config(engine_config), **from_generation_config(call.get("generation_config"))}
    if "temperature" in given and "do_sample" not in given:
        settings.pop("do_sample", None)  # an explicit temperature decides alone: 0 is greedy
    if "stop" in given:
        settings.pop("stop_strings", None)
    settings.update(given)
    if "max_tokens" in settings:  # OpenAI's name, with OpenAI's meaning (SamplingParams.fits_window)
        budget = settings.pop("max_tokens")
        if "max_new_tokens" in given:
            raise PromptCacheError("give max_tokens (OpenAI's: refused when it does not fit the context window) or "
                                   "max_new_tokens (transformers': cut at the window), not both", param="max_tokens")
        if not _is_int(budget) or budget < 1:
            raise PromptCacheError(f"max_tokens must be a positive integer, got {budget!r}", param="max_tokens")
        settings.update(max_new_tokens=budget, fits_window=True)
    settings.setdefault("max_new_tokens", 256)
    return SamplingParams.build(**settings)


class Sampler:
    """Greedy at temperature 0; otherwise temperature, top-k and nucleus (top-p) sampling."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0 and params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of one row of ``logits``, as a 0-d tensor on their device (read later,
        with the rest of the batch's tokens, in one transfer)."""
        p = self.params
        if p.temperature == 0:
            return torch.argmax(logits)
        # the top logit moved to 0 first, and the temperature kept where float32 still holds it: a
        # tiny temperature (any finite one is valid) then sends the others to -inf, its limit,
        # rather than every logit to inf (or 0 / 0) and the probabilities to NaN. An infinite
        # logit (a repetition penalty near 0 divides by it) becomes the largest finite one, so the
        # tokens that had it share the mass rather than inf - inf making it NaN.
        finfo = torch.finfo(torch.float32)
        logits = logits.float().clamp(max=finfo.max)
        logits = (logits - logits.max()) / max(p.temperature, finfo.tiny)
        if p.top_k is not None and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            drop[0] = False  # a top_p below float32's range would drop even the first
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=self.generator)[0]


class GeneratedTokenPenalties:
    """OpenAI's presence and frequency penalties as a logits processor (transformers has none):
    each token's logit less ``frequency`` times the count of it among the tokens generated so far,
    less ``presence`` once it is among them; the prompt's ``prompt_tokens`` are not counted (as
    in OpenAI and vLLM; transformers' repetition_penalty counts them)."""

    def __init__(self, prompt_tokens: int, presence: float, frequency: float) -> None:
        self.prompt_tokens, self.presence, self.frequency = prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_tokens:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class LogitBias:
    """OpenAI's ``logit_bias`` as a logits processor: each listed token's logit plus its bias
    (100 all but forces a token, -100 all but bans it)."""

    def __init__(self, bias: tuple[tuple[int, float], ...]) -> None:
        self.ids = torch.tensor([token for token, _ in bias], dtype=torch.long)
        self.values = torch.tensor([value for _, value in bias])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.ids.device != scores.device:  # moved once, on the first step
            self.ids, self.values = self.ids.to(scores.device), self.values.to(scores.device)
        return scores.index_add(1, self.ids, self.values.to(scores.dtype).expand(scores.shape[0], -1))


class TokenHistory:
    """What logits processors read (transformers' ``input_ids``: the prompt and the tokens
    generated so far) for every row of a batch, in one tensor allocated once on the device.

    Each step appends the fed tokens in one in-place scatter; a row's processors read a view of
    its filled part. (A list turned into a tensor at every step copied the whole history each
    time: quadratic in the answer's length.)
    """

    def __init__(self, prompts: Sequence[Sequence[int]], steps: int, device: torch.device) -> None:
        width = max(len(p) for p in prompts) + steps
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
        self.ids = ids.to(device)
        self.prompt_lengths = [len(p) for p in prompts]
        self.appended = 0  # tokens appended to every row
        self._at = torch.tensor(self.prompt_lengths, dtype=torch.long, device=device)[:, None]

    def view(self, row: int) -> torch.Tensor:
        """Row ``row``'s history, ``[1, length]`` (a view)."""
        return self.ids[row : row + 1, : self.prompt_lengths[row] + self.appended]

    def append(self, tokens: torch.Tensor) -> None:
        """Append ``tokens [rows, 1]`` (on the device) to every row."""
        self.ids.scatter_(1, self._at, tokens)
        self._at += 1
        self.appended += 1
