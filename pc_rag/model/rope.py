"""How a model encodes positions, *measured* rather than guessed from the architecture name:
keys computed at two positions are compared. Identical keys mean the positions live outside the
KV (ALiBi); keys related by a RoPE rotation mean a module can be moved by rotating its keys
(:class:`RopeRotator`); anything else (learned absolute positions) pins modules to their schema
positions, as do RoPE variants whose frequencies change with the input length and rotary
embeddings whose keys move in no layout this module knows (``"rope_unrecognised"``)."""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from ..weights.int4 import Int4Linear
from .decoder import decoder_of

logger = logging.getLogger(__name__)

PositionKind = Literal["rope", "alibi", "learned", "rope_length_dependent", "rope_unrecognised"]


class RopeRotator:
    """Moves RoPE keys from one position to another with the model's own rotary frequencies.

    RoPE keys at position p are ``R(p) k``; ``R(p + d) k = R(d) R(p) k``, so moving by ``d`` is a
    rotation by ``d``. The frequencies are copied from the model's rotary module once, at
    construction, and the module is never called again: length-dependent variants (dynamic NTK,
    LongRoPE) change its ``inv_freq`` in place on every call, so calling it per request would race
    with other requests (such models are not moved at all, see :func:`inspect_model`). The
    rotary module multiplies cos/sin by an attention scaling (YaRN's mscale); the cached keys
    already carry it once, so a rotation leaves it out.
    """

    def __init__(self, model: Any, inv_freq: torch.Tensor | None = None, *, interleaved: bool = False) -> None:
        rotary = decoder_of(model).rotary_emb
        if inv_freq is None:
            found = frequency_candidates(rotary)
            if len(found) != 1:
                raise ValueError(f"{type(rotary).__name__} holds {len(found)} sets of RoPE frequencies: "
                                 "give the per-layer ones (inv_freq [layers, rotary_dim / 2]; probe_positions fits them)")
            inv_freq = found[0]
        # [rotary_dim / 2]: every layer alike; [layers, rotary_dim / 2]: a frequency set per layer
        # (Gemma 3's local and global layers; zeros for a layer without RoPE, whose keys never move)
        self.inv_freq = inv_freq.detach().to(torch.float32).clone()
        # which dims rotate together: the two halves of the rotary dims (Llama's rotate_half), or
        # neighbouring dims (interleaved pairs: Cohere's models)
        self.interleaved = interleaved
        scalings = [float(getattr(rotary, name) or 1.0) for name in dir(rotary)
                    if name.endswith("attention_scaling") and isinstance(getattr(rotary, name, None), (int, float))]
        self.scaling = scalings[0] if len(set(scalings)) == 1 else 1.0

    @property
    def per_layer(self) -> bool:
        """Whether layers rotate by different frequencies (a move's cos/sin then carry a layer dimension)."""
        return self.inv_freq.dim() == 2

    def cos_sin_many(self, deltas: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` for several moves at once (float32 math, as the model's): ``[len(deltas),
        rotary_dim]``, or with frequencies per layer ``[len(deltas), layers, 1, 1, rotary_dim]``, which
        broadcasts over keys ``[layers, kv_heads, tokens, head_dim]``."""
        inv_freq = self.inv_freq.to(like.device)
        deltas = deltas.to(like.device, torch.float32)
        angles = deltas.view(-1, *([1] * inv_freq.dim())) * inv_freq[None]
        angles = angles.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat([angles, angles], dim=-1)
        if self.per_layer:
            angles = angles[:, :, None, None, :]
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def cos_sin(self, delta: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_many(torch.tensor([delta]), like)
        return cos[0], sin[0]

    def rotate_into(self, out: torch.Tensor, keys: torch.Tensor, delta: int) -> None:
        """``out = keys`` moved by ``delta`` positions; keys are ``[..., seq, head_dim]``."""
        cos, sin = self.cos_sin(delta, keys)
        rotate_with(out, keys, cos, sin, interleaved=self.interleaved)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: rotate-half RoPE as ``x * cos + roll(x) * signed_sin(sin)``
    (the written decode step's form, :mod:`pc_rag.model.llama_step` and :mod:`pc_rag.model.fused_step`)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def pairs(x: torch.Tensor, rot: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the dims RoPE rotates together, as two tensors ``(a, b)`` (a pair is ``a[i], b[i]``):
    the first and second half of the ``rot`` rotary dims, or even and odd dims when ``interleaved``."""
    if interleaved:
        return x[..., 0:rot:2], x[..., 1:rot:2]
    return x[..., : rot // 2], x[..., rot // 2 : rot]


def rotate_with(out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> None:
    """``out = keys * cos + rotate_half(keys) * sin`` on the first ``cos.shape[-1]`` dims
    (``cos``/``sin`` in the layout of ``interleaved``, as :meth:`RopeRotator.cos_sin_many` gives them).

    Written into the destination directly, so a move costs no temporaries beyond one product;
    partial-rotary models keep the dims past the rotary ones as they are.
    """
    rot = cos.shape[-1]
    torch.mul(keys[..., :rot], cos, out=out[..., :rot])
    (out_a, out_b), (keys_a, keys_b), (sin_a, sin_b) = (pairs(x, rot, interleaved) for x in (out, keys, sin))
    out_a.addcmul_(keys_b, sin_a, value=-1.0)
    out_b.addcmul_(keys_a, sin_b)
    if rot < keys.shape[-1]:
        out[..., rot:].copy_(keys[..., rot:])


def rotate_in_place(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> None:
    """``keys = keys * cos + rotate_half(keys) * sin`` in place, for KV dequantized straight into a
    request's buffer (:mod:`pc_rag.kv.quantize`). On a CPU one leading index (a layer) at a time, so
    the scratch (half the rotary dims) stays in cache; on a GPU all at once (five kernels, not
    five per layer: launches are what a segment's rotation costs there)."""
    rot = cos.shape[-1]
    if keys.device.type != "cpu":
        parts = [(keys, cos, sin)]
    else:  # per layer; frequencies per layer (cos [layers, 1, 1, rotary_dim]) go with their layer
        parts = [(part, cos[layer] if cos.dim() == 4 else cos, sin[layer] if sin.dim() == 4 else sin) for layer, part in enumerate(keys)]
    for part, c, s in parts:
        (first, second), (cos_a, cos_b), (sin_a, sin_b) = (pairs(x, rot, interleaved) for x in (part, c, s))
        saved = first.clone()
        first.mul_(cos_a).addcmul_(second, sin_a, value=-1.0)
        second.mul_(cos_b).addcmul_(saved, sin_b)


def frequency_candidates(rotary: Any) -> list[torch.Tensor]:
    """The distinct RoPE frequency sets a rotary module holds: ``inv_freq`` (or, where a
    length-dependent variant rescales it in place, ``original_inv_freq``), or one per layer type
    (Gemma 3: ``sliding_attention_inv_freq``, ``full_attention_inv_freq``)."""
    found: list[torch.Tensor] = []
    for name, buffer in rotary.named_buffers(recurse=False):
        if not name.endswith("inv_freq") or name.endswith("original_inv_freq"):
            continue
        original = getattr(rotary, name[: -len("inv_freq")] + "original_inv_freq", None)
        chosen = original if isinstance(original, torch.Tensor) else buffer
        if not any(f.shape == chosen.shape and torch.equal(f, chosen) for f in found):
            found.append(chosen)
    if not found:  # a rotary module that keeps its frequencies as plain attributes
        for name in ("original_inv_freq", "inv_freq"):
            value = getattr(rotary, name, None)
            if isinstance(value, torch.Tensor):
                return [value]
    table = getattr(rotary, "embed_positions", None)
    if not found and isinstance(table, torch.Tensor) and table.dim() == 2 and table.shape[0] > 1 and table.shape[1] % 2 == 0:
        # GPT-J, CodeGen: a table of sin and cos per position ([positions, rotary_dim], the sines
        # first); position 1's angles are the frequencies themselves (each in (0, 1] radians)
        sin, cos = table[1].float().chunk(2)
        return [torch.atan2(sin, cos)]
    return found


def rope_windows(config: Any) -> tuple[int, int]:
    """The lengths at which length-dependent RoPE variants may switch frequencies: the smallest
    and the largest of the configured windows (LongRoPE switches past its original window,
    dynamic NTK past ``max_position_embeddings``); (0, 0) when none is configured."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    candidates = [getattr(config, "max_position_embeddings", 0), getattr(config, "original_max_position_embeddings", 0)]
    if isinstance(rope, dict):
        candidates.append(rope.get("original_max_position_embeddings", 0))
    windows = [int(c) for c in candidates if isinstance(c, int) and c > 0]
    return (min(windows), max(windows)) if windows else (0, 0)


def probe_positions(model: Any, forward_keys: Any) -> tuple[PositionKind, RopeRotator | None]:
    """Measure how ``model`` encodes positions (see module docstring), and for RoPE the rotator
    that moves its keys: one frequency set for every layer, or one per layer where layers differ
    (Gemma 3's local and global layers; no rotation for a layer without RoPE, as SmolLM3's), each
    layer's set chosen by which one moves its keys as the model does.

    ``forward_keys(token_ids, start)`` returns the layer keys of ``token_ids`` encoded alone at
    positions ``start, start+1, ...`` as ``[layers, kv_heads, n, head_dim]``. RoPE keys must
    rotate exactly both inside the original window and past it: length-dependent variants
    (dynamic NTK, LongRoPE) switch frequencies there, so a module encoded in a short prompt is
    not the module a long prompt would compute (``"rope_length_dependent"``: modules stay put).
    """
    ids = [11, 42, 7, 99]
    # a float32 model whose linear layers take bf16 activations (weights="int4") rounds as a 16-bit one
    full = model.dtype == torch.float32 and not any(isinstance(m, Int4Linear) for m in model.modules())
    tol = 1e-4 if full else 3e-2
    # in 16 bits the rounding compounds with depth: measured on a Llama-3-8B-shaped bf16 model on
    # an H100, 0.6% of the keys' scale at layer 0 and 5.6% at layer 31 for a true RoPE move. The
    # first layer (no attention before it: only rounding) is held to `tol`, the whole stack to
    # `deep`; a frequency switch or learned positions differ by O(0.1-1) already at layer 0.
    deep = tol if full else 0.15
    low, high = rope_windows(model.config.get_text_config(decoder=True))
    # inside every window, so that length-dependent variants still use their short frequencies
    delta = min(37, low - len(ids) - 1) if low > 2 * len(ids) else 37
    at_zero = forward_keys(ids, 0).float()
    scale = at_zero.abs().max().item() + 1e-6

    def rotates_to(delta: int, rotator: RopeRotator) -> bool:
        moved = forward_keys(ids, delta).float()
        rotated = torch.empty_like(at_zero)
        rotator.rotate_into(rotated, at_zero, delta)
        # the model's own float32 angles (position x frequency) round more the further they go:
        # measured ~1e-8 x position relative; allow 10x that, far below what a switch of
        # frequencies changes (O(0.1) at twice the window)
        return _close(rotated, moved, tol + 1e-7 * delta, deep + 1e-7 * delta)

    def _close(a: torch.Tensor, b: torch.Tensor, first: float, every: float) -> bool:
        error = (a - b).abs()
        return error[0].max().item() <= first * (a[0].abs().max().item() + 1e-6) and error.max().item() <= every * scale

    moved = forward_keys(ids, delta).float()
    if _close(at_zero, moved, tol, deep):
        return "alibi", None
    rotary = getattr(decoder_of(model), "rotary_emb", None)
    if rotary is not None:
        rotator = _fit(model, frequency_candidates(rotary), rotates_to, at_zero, moved, delta, tol, deep, scale)
        if rotator is not None and rotates_to(delta, rotator):
            # past the largest window: dynamic NTK rescales with the length there, LongRoPE has
            # switched to its long factors (twice the window, where the change is large)
            # (a sin/cos table, GPT-J's, ends at the window: nothing past it to measure)
            tabled = isinstance(getattr(rotary, "embed_positions", None), torch.Tensor)
            if high and not tabled and not rotates_to(2 * high + 1, rotator):
                logger.warning("RoPE frequencies change with the input length (dynamic/LongRoPE scaling): modules stay at schema positions")
                return "rope_length_dependent", None
            return "rope", rotator
        logger.warning("model has a rotary embedding but its keys do not rotate as RoPE: modules stay at schema positions")
        return "rope_unrecognised", None
    return "learned", None


def _fit(model: Any, candidates: list[torch.Tensor], rotates_to: Any, at_zero: torch.Tensor, moved: torch.Tensor, delta: int,
         tol: float, deep: float, scale: float) -> RopeRotator | None:
    """The rotator that moves ``at_zero`` onto ``moved``: the one frequency set for every layer, else
    a set per layer; in Llama's layout (the two halves of the rotary dims), else Cohere's pairs."""
    for interleaved in (False, True):
        if len(candidates) == 1 and rotates_to(delta, uniform := RopeRotator(model, candidates[0], interleaved=interleaved)):
            return uniform
        fitted = _fit_per_layer(model, candidates, at_zero, moved, delta, tol, deep, scale, interleaved)
        if fitted is not None:
            return fitted
    return None


def _fit_per_layer(model: Any, candidates: list[torch.Tensor], at_zero: torch.Tensor, moved: torch.Tensor, delta: int,
                   tol: float, deep: float, scale: float, interleaved: bool) -> RopeRotator | None:
    """A rotator whose layer ``l`` rotates by the candidate frequencies (or none: zeros) that move
    ``at_zero[l]`` onto ``moved[l]``; None when some layer matches none of them."""
    if not candidates:
        return None
    half = candidates[0].numel()
    options = [c.detach().to(torch.float32) for c in candidates if c.numel() == half] + [torch.zeros(half)]
    chosen = []
    for layer in range(at_zero.shape[0]):
        bound = (tol * (at_zero[0].abs().max().item() + 1e-6) if layer == 0 else deep * scale) + 1e-7 * delta * scale
        for inv_freq in options:
            rotated = torch.empty_like(at_zero[layer])
            RopeRotator(model, inv_freq, interleaved=interleaved).rotate_into(rotated, at_zero[layer], delta)
            if (rotated - moved[layer]).abs().max().item() <= bound:
                chosen.append(inv_freq)
                break
        else:
            return None
    if all(not f.any() for f in chosen):
        return None
    return RopeRotator(model, torch.stack(chosen), interleaved=interleaved)
