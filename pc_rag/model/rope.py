"""How a model encodes positions, *measured* rather than guessed from the architecture name:
keys computed at two positions are compared. Identical keys mean the positions live outside the
KV (ALiBi); keys related by a RoPE rotation mean a module can be moved by rotating its keys
(:class:`RopeRotator`); anything else (learned absolute positions) pins modules to their schema
positions, as do RoPE variants whose frequencies change with the input length."""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

PositionKind = Literal["rope", "alibi", "learned", "rope_length_dependent"]


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

    def __init__(self, model: Any) -> None:
        rotary = model.base_model.rotary_emb
        inv_freq = getattr(rotary, "original_inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor):
            inv_freq = rotary.inv_freq
        self.inv_freq = inv_freq.detach().to(torch.float32).clone()
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)

    def cos_sin_many(self, deltas: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[len(deltas), rotary_dim]`` for several moves at once (float32 math, as the model's)."""
        inv_freq = self.inv_freq.to(like.device)
        angles = deltas.to(like.device, torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def cos_sin(self, delta: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_many(torch.tensor([delta]), like)
        return cos[0], sin[0]

    def rotate_into(self, out: torch.Tensor, keys: torch.Tensor, delta: int) -> None:
        """``out = keys`` moved by ``delta`` positions; keys are ``[..., seq, head_dim]``."""
        cos, sin = self.cos_sin(delta, keys)
        rotate_with(out, keys, cos, sin)


def rotate_with(out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``out = keys * cos + rotate_half(keys) * sin`` on the first ``cos.shape[-1]`` dims.

    Written into the destination directly, so a move costs no temporaries beyond one product;
    partial-rotary models keep the dims past the rotary ones as they are.
    """
    rot = cos.shape[-1]
    half = rot // 2
    torch.mul(keys[..., :rot], cos, out=out[..., :rot])
    out[..., :half].addcmul_(keys[..., half:rot], sin[..., :half], value=-1.0)
    out[..., half:rot].addcmul_(keys[..., :half], sin[..., half:rot])
    if rot < keys.shape[-1]:
        out[..., rot:].copy_(keys[..., rot:])


def rotate_in_place(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``keys = keys * cos + rotate_half(keys) * sin`` in place, for KV dequantized straight into a
    request's buffer (:mod:`pc_rag.kv.quantize`). On a CPU one leading index (a layer) at a time, so
    the scratch (half the rotary dims) stays in cache; on a GPU all at once (five kernels, not
    five per layer: launches are what a segment's rotation costs there)."""
    rot = cos.shape[-1]
    half = rot // 2
    for part in (keys,) if keys.device.type != "cpu" else keys:
        first, second = part[..., :half], part[..., half:rot]
        saved = first.clone()
        first.mul_(cos[..., :half]).addcmul_(second, sin[..., :half], value=-1.0)
        second.mul_(cos[..., half:rot]).addcmul_(saved, sin[..., half:rot])


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


def probe_position_kind(model: Any, forward_keys: Any) -> PositionKind:
    """Measure how ``model`` encodes positions (see module docstring).

    ``forward_keys(token_ids, start)`` returns the layer keys of ``token_ids`` encoded alone at
    positions ``start, start+1, ...`` as ``[layers, kv_heads, n, head_dim]``. RoPE keys must
    rotate exactly both inside the original window and past it: length-dependent variants
    (dynamic NTK, LongRoPE) switch frequencies there, so a module encoded in a short prompt is
    not the module a long prompt would compute (``"rope_length_dependent"``: modules stay put).
    """
    ids = [11, 42, 7, 99]
    tol = 1e-4 if model.dtype == torch.float32 else 3e-2
    # in 16 bits the rounding compounds with depth: measured on a Llama-3-8B-shaped bf16 model on
    # an H100, 0.6% of the keys' scale at layer 0 and 5.6% at layer 31 for a true RoPE move. The
    # first layer (no attention before it: only rounding) is held to `tol`, the whole stack to
    # `deep`; a frequency switch or learned positions differ by O(0.1-1) already at layer 0.
    deep = tol if model.dtype == torch.float32 else 0.15
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
        return "alibi"
    if getattr(model.base_model, "rotary_emb", None) is not None:
        rotator = RopeRotator(model)
        if rotates_to(delta, rotator):
            # past the largest window: dynamic NTK rescales with the length there, LongRoPE has
            # switched to its long factors (twice the window, where the change is large)
            if high and not rotates_to(2 * high + 1, rotator):
                logger.warning("RoPE frequencies change with the input length (dynamic/LongRoPE scaling): modules stay at schema positions")
                return "rope_length_dependent"
            return "rope"
        logger.warning("model has a rotary embedding but its keys do not rotate as RoPE: modules stay at schema positions")
    return "learned"
