"""What pc-rag needs to know about a model, derived once into a frozen :class:`ModelSpec` by
:func:`inspect_model`: position kind and RoPE rotation (:mod:`pc_rag.model.rope`), attention support,
KV shape, sliding window, special ids, chat markers (:mod:`pc_rag.prompt.chat`) and a fingerprint of
every weight. Loading lives in :mod:`pc_rag.model.loading` (re-exported here)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PromptCacheError
from ..forward.rotation import RopeRotator
from ..prompt.chat import chat_markers
from ..prompt.layout import ChatMarkers
from .rope import PositionKind, probe_positions, rope_windows

logger = logging.getLogger(__name__)


def model_fingerprint(model: Any, tokenizer: Any) -> str:
    """A hash of the config, every byte of every weight, the tokenizer and the versions that change KV.

    Every weight byte: an edit to a few rows of one matrix (a fine-tune, a patched embedding)
    changes the KV of every module, and a strided sample would miss it. Hashing is linear in the
    model size (the embedded 135M model: ~0.3 s, once per engine). Tensors that share storage
    (tied embeddings) are hashed once.
    """
    h = hashlib.sha256()
    h.update(model.config.to_json_string(use_diff=False).encode())
    for package in ("torch", "transformers"):
        h.update(f"{package}={importlib.metadata.version(package)}|".encode())
    seen: set[tuple[int, int]] = set()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if identity in seen:
                continue
            seen.add(identity)
            flat = tensor.detach().contiguous().reshape(-1)
            # raw bytes in chunks: no float conversion, bounded host memory for accelerator weights
            step = max(1, (64 << 20) // max(1, flat.element_size()))
            for start in range(0, flat.numel(), step):
                chunk = flat[start : start + step].to("cpu")
                h.update(chunk.view(torch.uint8).numpy().data)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# ModelSpec: every fact about the model that the rest of pc-rag needs, derived once
# ---------------------------------------------------------------------------------------------
PINNED_REASONS = {
    "learned": "learned absolute positions",
    "rope_length_dependent": "RoPE frequencies that change with the input length (dynamic NTK or LongRoPE scaling)",
    "rope_unrecognised": "a rotary embedding whose keys do not move as RoPE does in any layout pc-rag knows "
                         "(one frequency set or one per layer; halves or interleaved pairs of dims)",
}


@dataclass(frozen=True)
class ModelSpec:
    """What pc-rag knows about a model and its tokenizer, measured once by :func:`inspect_model`."""

    tokenizer: Any = field(repr=False, compare=False)
    device: torch.device
    dtype: torch.dtype
    position_kind: PositionKind
    # RoPE keys are moved with it (None: positions are not in the keys, or modules cannot move)
    rotator: RopeRotator | None = field(repr=False, compare=False)
    attn_implementation: str | None
    # every computed token of a prompt in one forward pass, causality given by positions (a mask)
    one_pass: bool
    # split attention (pc_rag_sdpa): module KV attended to where it is stored, shared by a batch
    split: bool
    layers: int
    kv_heads: int
    head_dim: int
    heads_per_kv: int
    # sliding-window attention: the window (keys with position > query - window are seen) and
    # which layers use it; (None, ()) for models without
    sliding_window: int | None
    window_layers: tuple[bool, ...]
    context_window: int | None
    # why context_window is shorter than the model's own (attention pc-rag does not reproduce past it)
    context_reason: str | None
    # cached KV is exact only for prompts within this many positions (length-dependent RoPE)
    exact_window: int | None
    bos_ids: tuple[int, ...]
    bos_text: str | None
    placeholder_id: int
    stop_token_ids: frozenset[int]
    separator_ids: tuple[int, ...]  # what follows every document's text in its module
    markers: ChatMarkers
    fingerprint: str  # model + tokenizer + dtype + positions + chat markers + versions
    # what a request's KV buffers (and module KV, unless store_dtype says otherwise) hold: the model's
    # dtype, or 16 bits under a float32 model (PromptCache's kv_dtype=); attention reads it in the model's
    kv_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", self.dtype)

    @property
    def movable(self) -> bool:
        """Whether cached modules can be placed at positions other than those they were encoded at."""
        return self.position_kind in ("rope", "alibi")

    @property
    def pinned_reason(self) -> str:
        """Why modules cannot move on this model (for error messages)."""
        return PINNED_REASONS.get(self.position_kind, "")

    @property
    def mixed_window(self) -> bool:
        """Some layers attend through a sliding window and others do not (masks per layer type)."""
        return self.sliding_window is not None and not all(self.window_layers)

    # character offsets of module texts, for drop-in alignment (bounded; see offsets())
    _offsets: dict[str, list[tuple[int, int]]] = field(default_factory=dict, repr=False, compare=False)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def tokenize_many(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`tokenize` of each text, in one call (a fast tokenizer encodes a batch in parallel)."""
        texts = list(texts)
        if len(texts) < 2:
            return [self.tokenize(t) for t in texts]
        return [ids if text else [] for text, ids in zip(texts, self.tokenizer(texts, add_special_tokens=False)["input_ids"])]

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """The character span of each token of ``text`` tokenised alone (kept for the 4,096 texts last asked)."""
        held = self._offsets.get(text)
        if held is None:
            held = [tuple(span) for span in self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
            if len(self._offsets) >= 4096:
                self._offsets.clear()
            self._offsets[text] = held  # type: ignore[assignment]
        return held  # type: ignore[return-value]

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        size = torch.empty((), dtype=dtype or self.kv_dtype).element_size()
        return self.layers * 2 * self.kv_heads * self.head_dim * size


def _placeholder_token(tokenizer: Any) -> int:
    for attr in ("unk_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0


def _bos_ids(tokenizer: Any) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if bos is not None and with_special and with_special[0] == bos else []


def _stop_token_ids(model: Any, tokenizer: Any, markers: ChatMarkers) -> set[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    # the end-of-turn marker of the chat template ends an answer too (e.g. <|im_end|>)
    end = tokenizer(markers.ends["assistant"].strip(), add_special_tokens=False)["input_ids"]
    if len(end) == 1:
        ids.add(end[0])
    return ids


def _receives_keywords(model: Any, decoder: Any, shape: tuple[int, int, int], windows: list[int | None]) -> bool:
    """Whether split attention may run (:func:`pc_rag.forward.attention.receives_keywords`); when it
    may not, the model is served by the paths that need no keyword (a batch copies what its rows
    import), and one log line says why."""
    from ..forward import attention

    why = attention.receives_keywords(model, decoder, shape, windows)
    if why is not None:
        logger.warning("%s: %s; its requests are served without shared-module attention, fused prefill or scored recovery",
                       type(model).__name__, why)
    return why is None


def _sliding_window(config: Any, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None, ()
    types = getattr(config, "layer_types", None)
    if types is None:
        return int(window), (True,) * layers
    windowed = tuple(t == "sliding_attention" for t in types)
    return (int(window), windowed) if any(windowed) else (None, ())


def _context_window(config: Any) -> tuple[int | None, str | None]:
    """The positions pc-rag serves exactly: the model's context window, or less where its attention
    changes past a position in ways pc-rag's masks do not follow (and why).

    Llama 4: layers of type "chunked_attention" see only their own chunk of
    ``attention_chunk_size`` tokens; its layers without RoPE scale queries by a temperature that
    grows from position ``floor_scale - 1`` on (read from the cache's length, not the positions).
    Within both, attention is plain causal attention."""
    window = int(getattr(config, "max_position_embeddings", 0) or 0) or None
    limits = []
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and "chunked_attention" in (getattr(config, "layer_types", None) or ("chunked_attention",)):
        limits.append((int(chunk), f"chunked attention ({int(chunk)}-token chunks)"))
    floor = getattr(config, "floor_scale", None)
    if getattr(config, "attn_temperature_tuning", False) and floor and 0 in (getattr(config, "no_rope_layers", None) or ()):
        limits.append((int(floor) - 1, f"query temperature tuning from position {int(floor) - 1} on"))
    limits = [(limit, why) for limit, why in limits if window is None or limit < window]
    if not limits:
        return window, None
    limit = min(limit for limit, _ in limits)
    return limit, f"{' and '.join(why for _, why in limits)}, which pc-rag does not reproduce beyond {limit} positions"


def inspect_model(model: Any, tokenizer: Any, *, separator: str = "\n\n") -> ModelSpec:
    """Measure and collect what pc-rag needs to know about ``model`` (see :class:`ModelSpec`).

    Runs a few tiny forward passes (the position probe), so build it once per model.
    """
    from ..forward import attention
    from ..forward.forward import Forward, cache_keyword
    from ..kv.shape import check_cached_shape, kv_shape

    attention.install(model)
    layers, kv_heads, head_dim = kv_shape(model)  # refuses, by name, models whose state is not reusable KV
    forward = Forward(model)
    check_cached_shape(model, forward.decoder, (layers, kv_heads, head_dim), cache_keyword(model))  # ... and misleading configs
    config = model.config.get_text_config(decoder=True)
    markers = chat_markers(tokenizer)
    try:
        position_kind, rotator = probe_positions(model, forward.keys_at)
    except PromptCacheError:
        raise
    except Exception as err:  # the first passes through pc-rag's KV buffers: a layout they do not fit
        raise PromptCacheError(f"{type(model).__name__} does not run on pc-rag's KV buffers ({type(err).__name__}: {err}); "
                               "its architecture is not supported") from err
    implementation = getattr(model.config, "_attn_implementation", None)
    one_pass = position_kind == "rope" and attention.accepts_custom_mask(model)
    window, window_layers = _sliding_window(config, layers)
    windows = [window if window and (not window_layers or window_layers[i]) else None for i in range(layers)]
    split = one_pass and implementation == attention.ATTENTION_NAME and _receives_keywords(
        model, forward.decoder, (layers, config.num_attention_heads, kv_heads), windows)
    bos = _bos_ids(tokenizer)
    exact_window = rope_windows(config)[0] if position_kind == "rope_length_dependent" else None
    window_limit, window_reason = _context_window(config)
    fingerprint = hashlib.sha256(
        f"{model_fingerprint(model, tokenizer)}|{model.dtype}|{position_kind}|{markers}".encode()
    ).hexdigest()[:32]
    return ModelSpec(
        tokenizer=tokenizer,
        device=model.device,
        dtype=model.dtype,
        position_kind=position_kind,
        rotator=rotator,
        attn_implementation=implementation,
        one_pass=one_pass,
        split=split,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        heads_per_kv=config.num_attention_heads // kv_heads,
        sliding_window=window,
        window_layers=window_layers,
        context_window=window_limit,
        context_reason=window_reason,
        exact_window=exact_window,
        bos_ids=tuple(bos),
        bos_text=getattr(tokenizer, "bos_token", None) if bos else None,
        placeholder_id=_placeholder_token(tokenizer),
        stop_token_ids=frozenset(_stop_token_ids(model, tokenizer, markers)),
        separator_ids=tuple(tokenizer(separator, add_special_tokens=False)["input_ids"]),
        markers=markers,
        fingerprint=fingerprint,
    )
