"""Moving RoPE keys from one position to another: the rotation with the model's own frequencies
(:class:`RopeRotator`), applied out of place or in place, half-split or interleaved. What a model's
positions are is measured elsewhere (:mod:`pc_rag.model.rope`)."""

from __future__ import annotations

from typing import Any

import torch

from .decoder import decoder_of


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
    (the written decode step's form, :mod:`pc_rag.forward.llama_step` and :mod:`pc_rag.forward.fused_step`)."""
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
