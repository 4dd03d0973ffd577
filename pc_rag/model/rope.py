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

from ..forward.decoder import decoder_of
from ..forward.rotation import RopeRotator, frequency_candidates
from ..weights.int4 import Int4Linear

logger = logging.getLogger(__name__)

PositionKind = Literal["rope", "alibi", "learned", "rope_length_dependent", "rope_unrecognised"]


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
