"""Module KV at rest in 8 or 4 bits: what every tier holds under ``kv_quantization``.

The layout is KIVI's (arXiv:2402.02750, also transformers' ``QuantizedCache``): keys are
quantized per channel (a few channels carry large outliers across all tokens, so each channel
gets its own range) within groups of tokens; values per token within groups of channels. Each
group stores a scale and an offset (bfloat16: the range of float32 in two bytes) beside its
codes, ``x ~ code * scale + offset``, asymmetric and unsigned; 4-bit codes are packed two to a
byte along the channels.

Rounding the scale and offset to bfloat16 would move the grid off the data: the offset is
rounded down and the scale up before the codes are computed from them, so every value lies on
the grid and ``|x - dequantize(quantize(x))| <= scale / 2`` holds for every element (with
``scale`` the stored one). Tests check exactly that bound.

Plain torch ops rather than a library: optimum-quanto and HQQ quantize weights (per output
channel, packed for their matmul kernels); module KV is read back by slices of tokens into a
request's buffer, and the dequantization here writes straight into that buffer (three in-place
passes, no temporary the size of the output: 14 ms for 4K tokens of SmolLM2 keys on 2 CPU cores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PromptCacheError

STORE_SCALE_DTYPE = torch.bfloat16
_SLACK = 2.0**-7  # bfloat16 rounds to 8 significant bits: moving by this much first keeps the rounding on the safe side


@dataclass(frozen=True)
class Scheme:
    """How one ``kv_quantization`` setting packs KV."""

    name: str
    bits: int
    key_tokens: int  # most tokens per key group (keys: one range per channel per group of tokens)
    value_channels: int  # channels per value group (values: one range per token per group of channels)

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def key_groups(self, tokens: int) -> tuple[int, int]:
        """(groups, tokens per group) for a module of ``tokens``: balanced groups of at most
        ``key_tokens`` (a 143-token module is 2 groups of 72, not 128 + 15)."""
        groups = max(1, math.ceil(tokens / self.key_tokens))
        return groups, max(1, math.ceil(tokens / groups))

    def value_group(self, head_dim: int) -> int:
        return self.value_channels if head_dim % self.value_channels == 0 else head_dim

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int, tokens: int) -> float:
        """Stored bytes per token of a module of ``tokens`` (codes, ranges and the token's position)."""
        channels = layers * kv_heads * head_dim
        codes = 2 * channels * self.bits / 8
        groups, _ = self.key_groups(tokens)
        key_ranges = channels * groups * 4 / tokens
        value_ranges = layers * kv_heads * (head_dim // self.value_group(head_dim)) * 4
        return codes + key_ranges + value_ranges + 8


SCHEMES: dict[str, Scheme] = {
    "int8": Scheme("int8", 8, key_tokens=128, value_channels=64),
    "int4": Scheme("int4", 4, key_tokens=64, value_channels=32),
}


def scheme_for(setting: Any) -> Scheme | None:
    """The scheme named by ``kv_quantization`` (None: full precision); anything else is refused."""
    if setting is None:
        return None
    if not isinstance(setting, str) or setting not in SCHEMES:
        raise PromptCacheError(f"kv_quantization must be None, 'int8' or 'int4', got {setting!r}")
    return SCHEMES[setting]


def _ranges(low: torch.Tensor, high: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Offset and scale in the stored dtype such that [low, high] lies on the grid."""
    offset = (low - low.abs() * _SLACK).to(STORE_SCALE_DTYPE)
    scale = ((high - offset.float()) / levels).clamp_min(1e-8)
    scale = (scale * (1 + _SLACK)).to(STORE_SCALE_DTYPE)
    return scale, offset


def _codes(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, levels: int) -> torch.Tensor:
    return ((x - offset.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dimension (even channel low, odd channel high)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


@dataclass
class QuantizedModuleKV:
    """One module's KV as stored under a scheme: the quantized twin of :class:`pc_rag.kv.buffers.ModuleKV`.

    ``keys``/``values`` hold codes ``[layers, kv_heads, tokens, head_dim (/2 for 4 bits)]`` in
    uint8; ``key_scale``/``key_offset`` are ``[layers, kv_heads, groups, head_dim]`` (per channel
    per token group), ``value_scale``/``value_offset`` ``[layers, kv_heads, tokens, channel groups]``.
    """

    scheme: Scheme
    keys: torch.Tensor
    key_scale: torch.Tensor
    key_offset: torch.Tensor
    values: torch.Tensor
    value_scale: torch.Tensor
    value_offset: torch.Tensor
    positions: torch.Tensor  # [tokens] int64
    head_dim: int

    TENSORS = ("keys", "key_scale", "key_offset", "values", "value_scale", "value_offset")

    def __len__(self) -> int:
        return self.positions.numel()

    @property
    def layers(self) -> int:
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything stored, by name (safetensors' entries; ``positions`` included)."""
        return {**{name: getattr(self, name) for name in self.TENSORS}, "positions": self.positions}

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None, *, pin: bool = False) -> QuantizedModuleKV:
        """On ``device`` (``dtype`` is the model's: the codes keep theirs)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device)
            return t.pin_memory() if pin and t.device.type == "cpu" else t

        return QuantizedModuleKV(self.scheme, *(move(getattr(self, name)) for name in self.TENSORS),
                                 self.positions.to("cpu"), self.head_dim)

    # -- reading back -----------------------------------------------------------------------------
    def read(self, start: int = 0, end: int | None = None, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> torch.Tensor:
        """Tokens ``[start, end)`` dequantized: ``[layers, 2, kv_heads, n, head_dim]`` in ``dtype``."""
        end = len(self) if end is None else end
        out = torch.empty(self.layers, 2, self.keys.shape[1], end - start, self.head_dim, dtype=dtype,
                          device=device if device is not None else self.keys.device)
        self.read_into(out, start, end)
        return out

    def read_into(self, out: torch.Tensor, start: int, end: int) -> None:
        """Dequantize tokens ``[start, end)`` into ``out`` ``[layers, 2, kv_heads, n, head_dim]`` (any
        strides with a contiguous last dimension: a slice of a request's buffer)."""
        self._unpack_into(out[:, 0], self.keys[:, :, start:end])
        self._unpack_into(out[:, 1], self.values[:, :, start:end])
        keys = out[:, 0]
        _, per_group = self.scheme.key_groups(len(self))
        first, last = start // per_group, (end - 1) // per_group
        scale = self.key_scale[:, :, first : last + 1].to(out.device, out.dtype)
        offset = self.key_offset[:, :, first : last + 1].to(out.device, out.dtype)
        if out.device.type != "cpu" and last > first:
            # a GPU: the ranges gathered per token, two kernels (launches cost more than the bytes)
            index = torch.arange(start, end, device=out.device) // per_group - first
            keys.mul_(scale.index_select(2, index)).add_(offset.index_select(2, index))
        else:
            token = start
            while token < end:  # a CPU: one multiply-add per key group the range touches, no temporaries
                group = token // per_group
                stop = min(end, (group + 1) * per_group)
                part = keys[:, :, token - start : stop - start]
                part.mul_(scale[:, :, group - first : group - first + 1]).add_(offset[:, :, group - first : group - first + 1])
                token = stop
        width = self.scheme.value_group(self.head_dim)
        values = out[:, 1].unflatten(-1, (self.head_dim // width, width))
        values.mul_(self.value_scale[:, :, start:end, :, None].to(out.device, out.dtype))
        values.add_(self.value_offset[:, :, start:end, :, None].to(out.device, out.dtype))

    def _unpack_into(self, out: torch.Tensor, codes: torch.Tensor) -> None:
        if codes.device != out.device:
            codes = codes.to(out.device, non_blocking=True)
        if self.scheme.bits == 8:
            out.copy_(codes)
            return
        out[..., 0::2].copy_(codes & 0x0F)
        out[..., 1::2].copy_(codes >> 4)


def quantize(kv: torch.Tensor, positions: torch.Tensor, scheme: Scheme) -> QuantizedModuleKV:
    """``kv`` ``[layers, 2, kv_heads, tokens, head_dim]`` under ``scheme`` (see module docstring)."""
    layers, _, heads, tokens, head_dim = kv.shape
    if scheme.bits == 4 and head_dim % 2:
        raise PromptCacheError(f"int4 packs two channels per byte: head_dim {head_dim} is odd")
    x = kv.float()
    keys, values = x[:, 0], x[:, 1]
    # keys: per channel within balanced groups of tokens (the last group padded with its own last token)
    groups, per_group = scheme.key_groups(tokens)
    padded = keys
    if groups * per_group > tokens:
        padded = torch.cat([keys, keys[:, :, -1:].expand(-1, -1, groups * per_group - tokens, -1)], dim=2)
    grouped = padded.unflatten(2, (groups, per_group))
    key_scale, key_offset = _ranges(grouped.amin(dim=3), grouped.amax(dim=3), scheme.levels)
    key_codes = _codes(grouped, key_scale[:, :, :, None], key_offset[:, :, :, None], scheme.levels).flatten(2, 3)[:, :, :tokens]
    # values: per token within groups of channels
    width = scheme.value_group(head_dim)
    split = values.unflatten(-1, (head_dim // width, width))
    value_scale, value_offset = _ranges(split.amin(dim=-1), split.amax(dim=-1), scheme.levels)
    value_codes = _codes(split, value_scale[..., None], value_offset[..., None], scheme.levels).flatten(-2)
    if scheme.bits == 4:
        key_codes, value_codes = _pack4(key_codes), _pack4(value_codes)
    return QuantizedModuleKV(scheme, key_codes.contiguous(), key_scale, key_offset, value_codes.contiguous(), value_scale,
                             value_offset, positions.to("cpu"), head_dim)


def from_tensors(tensors: dict[str, torch.Tensor], scheme: Scheme, head_dim: int) -> QuantizedModuleKV:
    """A stored entry's tensors (safetensors) back as a module; the shapes are checked by
    :meth:`pc_rag.kv.records.KVShape.problem` before use."""
    missing = [name for name in (*QuantizedModuleKV.TENSORS, "positions") if name not in tensors]
    if missing:
        raise PromptCacheError(f"a {scheme.name} entry without {', '.join(missing)}")
    return QuantizedModuleKV(scheme, *(tensors[name] for name in QuantizedModuleKV.TENSORS), tensors["positions"], head_dim)


def expected_shapes(scheme: Scheme, layers: int, kv_heads: int, head_dim: int, tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every stored tensor of a ``tokens``-long module under ``scheme``."""
    packed = head_dim * scheme.bits // 8
    groups, _ = scheme.key_groups(tokens)
    channel_groups = head_dim // scheme.value_group(head_dim)
    return {
        "keys": ((layers, kv_heads, tokens, packed), torch.uint8),
        "key_scale": ((layers, kv_heads, groups, head_dim), STORE_SCALE_DTYPE),
        "key_offset": ((layers, kv_heads, groups, head_dim), STORE_SCALE_DTYPE),
        "values": ((layers, kv_heads, tokens, packed), torch.uint8),
        "value_scale": ((layers, kv_heads, tokens, channel_groups), STORE_SCALE_DTYPE),
        "value_offset": ((layers, kv_heads, tokens, channel_groups), STORE_SCALE_DTYPE),
    }
