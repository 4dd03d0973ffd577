"""The C decode step's arguments (``llama_step.c``'s ``product_t``, ``layer_t``, ``step_t`` and ``shared_t``) as
ctypes structures, and their layout checked against the library's own when it loads.

The structures are written twice, in C and here; :func:`layout_agrees` compares every size and
field offset the C compiler chose (``llama_step_layout``) with ctypes', so a field added on one side
only refuses the library at load instead of handing the step a misread pointer.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_int64, c_void_p

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
# a layer's norm weights (null where it has none)
NORMS = ("attention_norm", "mlp_norm", "attention_out_norm", "mlp_out_norm", "query_norm", "key_norm")
# a layer's scalars (eps of each norm, attention scaling, residual scale, the scores' soft cap: 0 none)
SCALARS = ("attention_eps", "mlp_eps", "attention_out_eps", "mlp_out_eps", "query_key_eps", "scaling", "residual_scale", "softcap")


class Product(ctypes.Structure):
    """One linear layer in blocks (``product_t``)."""

    _fields_ = [("values", c_void_p), ("scales", c_void_p), ("minimums", c_void_p), ("bias", c_void_p),
                ("out_features", c_int64), ("in_features", c_int64), ("bits", c_int64)]


class Layer(ctypes.Structure):
    """One decoder layer's norms, products, and what each step points it at: its KV storage, RoPE and mask (``layer_t``)."""

    _fields_ = [*((name, c_void_p) for name in NORMS), *((name, c_float) for name in SCALARS),
                ("per_head", c_int), *((name, Product) for name in LINEARS),
                *((name, c_void_p) for name in ("keys", "values", "cos", "sin", "mask_add", "mask_keep"))]


class Step(ctypes.Structure):
    """One decode step over every layer (``step_t``)."""

    _fields_ = [("layers", c_void_p), *((name, c_int64) for name in ("n_layers", "rows", "hidden", "heads", "kv_heads", "head_dim",
                                                                   "intermediate")),
                ("state", c_void_p), ("final_norm", c_void_p), ("final_eps", c_float), ("norm_offset", c_float), ("activation", c_int),
                *((name, c_int64) for name in ("column", "entries", "capacity", "row_stride", "head_stride", "entry_stride")),
                ("lo", c_void_p), ("hi", c_void_p), ("work", c_void_p),
                ("work_floats", c_int64), ("threads", c_int), ("head", Product), ("logits", c_void_p),
                ("activation_bits", c_int), ("shared", c_void_p), ("n_shared", c_int64), ("kv_kind", c_int)]


class Shared(ctypes.Structure):
    """Module KV that several rows read where it is stored (``shared_t``): layer 0's keys and values, the
    strides to the others, the rows that read it, the rotation back by its move, APE's adjustment."""

    _fields_ = [("keys", c_void_p), ("values", c_void_p),
                *((name, c_int64) for name in ("entries", "layer_stride", "head_stride", "entry_stride")),
                ("rows", c_void_p), ("n_rows", c_int64), ("cos", c_void_p), ("sin", c_void_p), ("score_scale", c_float),
                ("log_scale", c_float)]


STRUCTURES = (Product, Layer, Step, Shared)


def expected_layout(structures: tuple[type[ctypes.Structure], ...] = STRUCTURES) -> list[int]:
    """Sizes of the structures, then every field's offset in declaration order, as ctypes lays them out."""
    return [ctypes.sizeof(s) for s in structures] + [getattr(s, name).offset for s in structures for name, _ in s._fields_]


def layout_agrees(lib: ctypes.CDLL, structures: tuple[type[ctypes.Structure], ...] = STRUCTURES) -> str | None:
    """None where the library lays the step's arguments out as ``structures`` (:class:`Product`,
    :class:`Layer`, :class:`Step`, :class:`Shared`) do; else how they differ."""
    expected = expected_layout(structures)
    buffer = (c_int64 * (len(expected) + 8))()
    function = lib.llama_step_layout
    function.argtypes, function.restype = [c_void_p, c_int64], c_int64
    written = function(buffer, len(buffer))
    reported = list(buffer[:min(written, len(buffer))])
    if reported == expected:
        return None
    return f"the C step's structures are laid out {reported}, the ctypes ones {expected}"
