"""A decode step of a Llama-family model written out as plain tensor ops, gpt-fast style.

A decode step of the embedded SmolLM2-135M on the 2-core development CPU took 52 ms through
transformers' modules, of which 27 in the linear layers, 10 in attention and ~15 in the rest: 30
layers of module calls, keyword plumbing, cache objects, the attention interface's dispatch and
the small ops of norms and RoPE, all of it per token (``benchmarks/decode_step.py``).
:class:`LlamaDecodeStep` runs the same computation over the same modules (their weights in
whatever precision they hold: float32, ``Float16Linear``, ``Int4Linear``) and the same KV buffer,
op for op as transformers' Llama code does it (the same RMSNorm, RoPE and SDPA call with a key
head's queries stacked), in one loop: 44 ms, the rest down to ~7. Where the linear layers are
pc-rag's blocks (``weights="int4"``), the same step runs in one C call instead
(:mod:`pc_rag.forward.fused_step`), proved here alike.

It serves only what it reproduces: the decoder layer classes in :data:`FAMILIES` (Llama,
Mistral, Qwen2: the same layer with or without biases; Qwen3's query and key norms per head, OLMo 2's
over the whole projection and its norms after attention and MLP instead of before, Granite's
multipliers, Phi-3's joined projections, Gemma 3's four norms of 1 + weight, GELU, soft-capped logits
and RoPE and masks by layer type; Gemma 2's, with soft-capped attention scores and no query/key norms;
SmolLM3's layers without RoPE), SiLU or GELU's tanh form, SDPA or eager attention, a decode step (one new
token per row) under one mask tensor, attending by extents and over shared KV as ``pc_rag_sdpa`` does
(shared KV only without a sliding window, neither with capped scores), and no forward hook on a module it does not call
(:meth:`LlamaDecodeStep.serves`). Everything else runs the model as before. :func:`written_step`
proves the step on the model itself before it is used: each case of :func:`disagreement` on the
same random cache must give the model's logits (:data:`TOLERANCE`), or the model keeps its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ..kv.buffers import KVBuffer, read_at
from ..weights import blocks
from . import row_extents, shared_attention
from .attention import ATTENTION_NAME, CONFIG_WINDOW
from .decoder import decoder_of, language_model_of
from .fused_step import FusedStep, Rows, module_of
from .rotation import RopeRotator, signed_sin

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """How a decoder layer class departs from Llama's layer (RMSNorm before attention and MLP, q/k/v/o
    projections, biases optional, rotate-half RoPE, SiLU-gated MLP, plain residuals)."""

    query_key_norm: str | None = None  # RMSNorm of queries and keys before RoPE: "head" (each head), "projection" (all)
    # where the norms are: "before" attention and the MLP; "after" them, on their outputs before the residual
    # (OLMo 2); "around": both (Gemma 3: input, post-attention, pre- and post-feedforward norms)
    norms: str = "before"
    norm_offset: float = 0.0  # every RMSNorm scales by offset + weight (Gemma: 1 + weight)
    multipliers: bool = False  # Granite: embeddings, residual branches and logits scaled by the config's multipliers
    rope_by_layer_type: bool = False  # the rotary module takes the layer's type: frequencies per type (Gemma 3)
    activation_key: str = "hidden_act"  # the config's name for the MLP's activation
    joined: bool = False  # one projection computes q, k and v, one gate and up (Phi-3's qkv_proj, gate_up_proj)
    logit_softcap: bool = False  # the model soft-caps its logits by config.final_logit_softcapping (Gemma 2 and 3)
    attention_softcap: bool = False  # and its attention scores by config.attn_logit_softcapping (Gemma 2), where set
    rope_optional: bool = False  # a layer whose attention's use_rope is false turns no query or key (SmolLM3)


# decoder layers whose decode step is the one written out here (transformers 5.x), by class name
FAMILIES = {"LlamaDecoderLayer": Family(), "MistralDecoderLayer": Family(), "Qwen2DecoderLayer": Family(),
            "Qwen3DecoderLayer": Family(query_key_norm="head"), "GraniteDecoderLayer": Family(multipliers=True),
            "Olmo2DecoderLayer": Family(query_key_norm="projection", norms="after"),
            "Phi3DecoderLayer": Family(joined=True),
            "Gemma3DecoderLayer": Family(query_key_norm="head", norms="around", norm_offset=1.0, rope_by_layer_type=True,
                                         activation_key="hidden_activation", logit_softcap=True),
            "Gemma2DecoderLayer": Family(norms="around", norm_offset=1.0, activation_key="hidden_activation", logit_softcap=True,
                                         attention_softcap=True),
            "SmolLM3DecoderLayer": Family(rope_optional=True)}
# the MLP activations it computes, by the config's name: SiLU, and GELU's tanh form (as F.gelu(approximate="tanh"))
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
LAYER_CLASSES = tuple(FAMILIES)
# largest |logit difference| against the model's own step, relative to the largest logit. The tensor ops
# agree bitwise; the C step (fused_step) sums in its own order, and the proof's random cache amplifies
# rounding: embeddings scaled by 1 + 1e-7 noise moved the embedded model's logits by 4.2e-5 of the largest
TOLERANCE = 1e-3


@dataclass(frozen=True)
class _Layer:
    """What one decoder layer's step reads. A norm's weight is None where the layer has no such norm."""

    attention_norm: torch.Tensor | None  # before attention
    attention_eps: float
    q: Any
    k: Any
    v: Any
    o: Any
    mlp_norm: torch.Tensor | None  # before the MLP
    mlp_eps: float
    gate: Any
    up: Any
    down: Any
    scaling: float
    attention: Any  # the layer's attention module (split attention reads its index)
    query_norm: torch.Tensor | None = None  # of the queries and keys before RoPE, over each head or the whole projection
    key_norm: torch.Tensor | None = None
    query_key_eps: float = 0.0
    per_head: bool = True
    attention_out_norm: torch.Tensor | None = None  # of attention's output before the residual (OLMo 2)
    attention_out_eps: float = 0.0
    mlp_out_norm: torch.Tensor | None = None  # of the MLP's output before the residual
    mlp_out_eps: float = 0.0
    residual_scale: float = 1.0  # each branch's output times this before the residual (Granite)
    layer_type: str | None = None  # the config's type of it: which of a dict of masks it reads ("sliding_attention", ...)
    softcap: float = 0.0  # attention scores as tanh(s / softcap) * softcap before the mask (Gemma 2; 0: as they are)
    rotates: bool = True  # RoPE turns its queries and keys (False: SmolLM3's layers without RoPE)


def _eps(norm: Any) -> float:
    """An RMSNorm module's epsilon (Llama's norms hold it as variance_epsilon, Gemma's as eps)."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """transformers' Llama RMSNorm, op for op (float32 inside, the input's dtype out); with ``offset``,
    Gemma's: ``(x * rsqrt(mean(x^2) + eps)) * (offset + weight)`` in float32."""
    if offset:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (offset + weight.float())).type_as(x)
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [rows, heads, 1, dim]``: transformers' ``x * cos + rotate_half(x) * sin``,
    bit for bit, as ``x * cos + roll(x) * signed_sin`` (``signed_sin``: the first half of ``sin``
    negated, see :func:`~pc_rag.model.rope.signed_sin`): ``rotate_half`` is the halves swapped with the first negated,
    and negating a factor negates the product exactly. One roll instead of two slices, a negation
    and a concatenation: 10 us against 48 per call on the development CPU."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float,
                          softcap: float) -> torch.Tensor:
    """Gemma 2's eager attention of ``q [rows, heads, 1, dim]`` over ``keys``/``values [rows, kv_heads, entries, dim]``:
    ``softmax(tanh(q k^T * scaling / softcap) * softcap + mask) v`` (a boolean ``mask``: False excluded), a key head's
    query heads stacked as its query rows (no key copies); ``[rows, heads, 1, dim]``."""
    rows, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    scores = torch.matmul(q.view(rows, kv_heads, heads // kv_heads, dim), keys.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values).view(rows, heads, 1, dim)


class LlamaDecodeStep:
    """One decode step of a Llama-family causal LM over a :class:`pc_rag.kv.buffers.KVBuffer`'s
    cache: ``(ids [rows, 1], positions [rows, 1], mask, cache) -> logits [rows, vocab]``, the
    signature of :meth:`pc_rag.forward.forward.Forward._model_step`."""

    def __init__(self, model: Any) -> None:
        self.model = language_model_of(model)
        decoder = decoder_of(model)
        config = self.model.config.get_text_config(decoder=True)
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm
        self.final_eps = _eps(self.norm)
        self.head = self.model.get_output_embeddings()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.family = FAMILIES[type(decoder.layers[0]).__name__]
        self.activation_name = getattr(config, self.family.activation_key)
        self.activation = ACTIVATIONS[self.activation_name]
        self.layer_types = list(getattr(config, "layer_types", None) or ()) or [None] * config.num_hidden_layers
        self._decoder_layers = list(decoder.layers[: config.num_hidden_layers])
        self._describe()
        # the rotary module's calls a step makes: one, or one per layer type (Gemma 3's local and global frequencies)
        self.rope_kinds = sorted(set(self.layer_types)) if self.family.rope_by_layer_type else [None]
        # Granite: the embeddings times this, the logits divided by that (1.0: neither)
        self.embedding_scale = float(config.embedding_multiplier) if self.family.multipliers else 1.0
        self.logits_divisor = float(config.logits_scaling) if self.family.multipliers else 1.0
        self.softcap = getattr(config, "final_logit_softcapping", None) if self.family.logit_softcap else None  # None: none
        self.shared_steps = 0  # steps run that read shared KV (tests read it)
        # a layer that slides its window over keys (Mistral; Qwen2's sliding layers): shared KV, whose
        # masks follow the window the model hands its attention, is left to the model's own step
        self.windowed = bool(getattr(config, "sliding_window", None)) and any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ("sliding_attention",)) or any(
            getattr(layer.attention, CONFIG_WINDOW, None) for layer in self.layers)
        # attention scores soft-capped (Gemma 2): split attention and extents run SDPA, which cannot cap them
        self.softcapped = any(layer.softcap for layer in self.layers)
        # the modules whose forward this step does not call (it calls the linear layers): a hook on
        # one (a steering vector, a probe added after the engine was built) sends steps back to the model
        called = {id(module_of(getattr(layer, name))) for layer in self.layers for name in ("q", "k", "v", "o", "gate", "up", "down")}
        self._unhooked = [decoder, self.embed, self.norm, self.model, *(
            part for layer in decoder.layers for part in layer.modules() if id(part) not in called)]
        # their hook tables (torch adds to them in place): one `any` over them a step, not ~300 attribute reads
        self._hook_tables = [table for module in self._unhooked for table in (module._forward_hooks, module._forward_pre_hooks)]
        # the whole step in one C call where the linear layers are pc-rag's blocks (None: tensor ops only)
        self.fused = FusedStep.build(self)

    def _describe(self) -> None:
        """Each layer as this step reads it (:class:`_Layer`: its norms' weights, its linear modules), read
        again when a weight may have been replaced since (:func:`~pc_rag.weights.blocks.weights_generation`:
        a norm's weight is a tensor held here, where a linear layer is a module read at each call)."""
        self.generation = blocks.weights_generation()  # before reading: a change while reading shows at the next step
        self.layers = [self._layer(layer, self.family, kind) for layer, kind in zip(self._decoder_layers, self.layer_types)]

    def serves(self, shared: Any, mask: Any = None, extents: Any = None) -> bool:
        """Whether this step runs a decode step that reads ``shared`` KV (None: none) under ``mask``, its rows
        attending by ``extents`` (None: all entries), as the model would: not where a hook would be skipped,
        nor shared KV through a sliding window, nor either through soft-capped scores; ``mask`` a tensor, or a
        dict holding a tensor for every layer's type (None: not asked)."""
        if isinstance(mask, dict) and not all(isinstance(mask.get(kind), torch.Tensor) for kind in self.layer_types):
            return False
        if self.softcapped and (shared is not None or extents is not None):
            return False
        return not self.hooked and (shared is None or not self.windowed)

    @property
    def hooked(self) -> bool:
        """Whether a forward hook would be skipped by this step (then the model's own runs)."""
        return bool(torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks) or any(
            self._hook_tables)

    @staticmethod
    def _layer(layer: Any, family: Family, layer_type: str | None) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp

        def norm(module: Any) -> tuple[torch.Tensor, float]:
            return module.weight, _eps(module)

        none = (None, 0.0)
        before = after = (none, none)
        if family.norms == "before":
            before = norm(layer.input_layernorm), norm(layer.post_attention_layernorm)
        else:  # after attention and the MLP, and where "around" before them too (Gemma 3's four norms)
            after = norm(layer.post_attention_layernorm), norm(layer.post_feedforward_layernorm)
            if family.norms == "around":
                before = norm(layer.input_layernorm), norm(layer.pre_feedforward_layernorm)
        query_key = {}
        if family.query_key_norm is not None:
            query_key = dict(query_norm=attn.q_norm.weight, key_norm=attn.k_norm.weight, query_key_eps=norm(attn.q_norm)[1],
                             per_head=family.query_key_norm == "head")
        if family.joined:  # rows of one product each, in the order the model slices them
            query, key = attn.config.num_attention_heads * attn.head_dim, attn.num_key_value_heads * attn.head_dim
            inner = mlp.gate_up_proj.out_features // 2
            q, k, v = Rows(attn.qkv_proj, 0, query), Rows(attn.qkv_proj, query, query + key), Rows(attn.qkv_proj, query + key, query + 2 * key)
            gate, up = Rows(mlp.gate_up_proj, 0, inner), Rows(mlp.gate_up_proj, inner, 2 * inner)
        else:
            q, k, v, gate, up = attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
        return _Layer(
            *before[0], q, k, v, attn.o_proj, *before[1], gate, up, mlp.down_proj,
            attn.scaling, attn, **query_key, attention_out_norm=after[0][0], attention_out_eps=after[0][1],
            mlp_out_norm=after[1][0], mlp_out_eps=after[1][1],
            residual_scale=float(layer.residual_multiplier) if family.multipliers else 1.0, layer_type=layer_type,
            softcap=float(getattr(attn, "attn_logit_softcapping", None) or 0.0) if family.attention_softcap else 0.0,
            rotates=bool(attn.use_rope) if family.rope_optional else True,
        )

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rms_norm(x, weight, eps, self.family.norm_offset)

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """cos and signed sin at ``positions [rows, 1]``, each ``[rows, 1, dim]``, by the layer type they are for (None: all)."""
        out = {}
        for kind in self.rope_kinds:
            cos, sin = self.rotary(hidden, positions, kind) if kind is not None else self.rotary(hidden, positions)
            out[kind] = cos, signed_sin(sin)
        return out

    def _projections(self, layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x [rows, 1, hidden]``, ``[rows, heads, 1, dim]`` by a view (with one token,
        heads-major is the projection's own order), queries and keys normed where the layer norms them."""
        rows = x.shape[0]
        if isinstance(layer.q, Rows):  # one product, sliced as Phi-3 slices it
            qkv = layer.q.linear(x)
            q, k, v = qkv[..., : layer.k.start], qkv[..., layer.k.start : layer.v.start], qkv[..., layer.v.start : layer.v.stop]
        else:
            q, k, v = layer.q(x), layer.k(x), layer.v(x)
        if layer.query_norm is not None and not layer.per_head:  # over the whole projection, as OLMo 2 does
            q, k = self._norm(q, layer.query_norm, layer.query_key_eps), self._norm(k, layer.key_norm, layer.query_key_eps)
        q, k, v = q.view(rows, self.heads, 1, -1), k.view(rows, self.kv_heads, 1, -1), v.view(rows, self.kv_heads, 1, -1)
        if layer.query_norm is not None and layer.per_head:  # each head over its dims, as Qwen3 and Gemma 3 do
            q, k = self._norm(q, layer.query_norm, layer.query_key_eps), self._norm(k, layer.key_norm, layer.query_key_eps)
        return q, k, v

    def _gated(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The MLP's ``act(gate(x)) * up(x)`` (Phi-3's ``up * act(gate)`` from one product: the same bits)."""
        if isinstance(layer.gate, Rows):
            gate, up = layer.gate.linear(x).chunk(2, dim=-1)
            return up * self.activation(gate)
        return self.activation(layer.gate(x)) * layer.up(x)

    def _residual(self, hidden: torch.Tensor, branch: torch.Tensor, norm: torch.Tensor | None, eps: float, scale: float) -> torch.Tensor:
        """``hidden`` plus a branch's output, normed first where the layer norms it (OLMo 2), scaled where it scales it (Granite)."""
        if norm is not None:
            branch = self._norm(branch, norm, eps)
        return hidden + (branch * scale if scale != 1.0 else branch)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | dict[str, torch.Tensor], cache: Any,
                 extents: row_extents.RowExtents | None = None, shared: shared_attention.SharedStep | None = None) -> torch.Tensor:
        """Feed ``ids [rows, 1]`` at ``positions [rows, 1]``, their KV written into ``cache`` (a
        :class:`KVBuffer`'s, fixed for decoding) and attending over it under ``mask [rows, 1, 1,
        entries]`` (or a dict of them by layer type, see :meth:`serves`); ``extents``: each row attends within its own (a CPU batch, see
        :mod:`pc_rag.forward.row_extents`); ``shared``: and over KV read in place (split attention,
        :mod:`pc_rag.forward.shared_attention`; see :meth:`serves`). The next logits, ``[rows, vocab]``."""
        self.shared_steps += shared is not None
        if blocks.weights_generation() != self.generation:
            self._describe()  # then the C step, whose generation is older, reads the layers again too
        if self.fused is not None:
            logits = self.fused(ids, positions, mask, cache, extents, shared)
            if logits is not None:
                return logits
        rows = ids.shape[0]
        hidden = self.embed(ids)  # [rows, 1, hidden]
        if self.embedding_scale != 1.0:
            hidden = hidden * self.embedding_scale
        tables = {kind: (cos[:, None], sin[:, None]) for kind, (cos, sin) in self.rope(hidden, positions).items()}  # every head
        group = self.heads // self.kv_heads
        masks = mask if isinstance(mask, dict) else None
        for index, layer in enumerate(self.layers):
            cos, sin = tables[layer.layer_type if self.family.rope_by_layer_type else None]
            mask = masks[layer.layer_type] if masks is not None else mask
            x = self._norm(hidden, layer.attention_norm, layer.attention_eps) if layer.attention_norm is not None else hidden
            q, k, v = self._projections(layer, x)
            if layer.rotates:
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys, values = cache.layers[index].update(k, v)
            keys, values = read_at(keys, values, q.dtype)
            if layer.softcap:  # as the model's eager attention computes it (SDPA cannot cap scores); serves() keeps the rest away
                out = _softcapped_attention(q, keys, values, mask, layer.scaling, layer.softcap)
            elif shared is not None:
                out = shared_attention.split_attention(layer.attention, q, keys, values, mask, layer.scaling, shared,
                                                       extents=extents)
            elif extents is not None:
                out = row_extents.attend(q, keys, values, mask, layer.scaling, extents)
            else:  # a key head's queries stacked as its query rows (transformers' pack_gqa): no key copies
                out = F.scaled_dot_product_attention(q.view(rows, self.kv_heads, group, -1), keys, values, attn_mask=mask,
                                                     scale=layer.scaling)
            out = out.reshape(rows, 1, -1)  # heads-major again, as o_proj reads them
            hidden = self._residual(hidden, layer.o(out), layer.attention_out_norm, layer.attention_out_eps, layer.residual_scale)
            x = self._norm(hidden, layer.mlp_norm, layer.mlp_eps) if layer.mlp_norm is not None else hidden
            hidden = self._residual(hidden, layer.down(self._gated(layer, x)), layer.mlp_out_norm, layer.mlp_out_eps,
                                    layer.residual_scale)
        hidden = self._norm(hidden, self.norm.weight, self.final_eps)
        return self.scaled_logits(self.head(hidden)[:, -1])

    def scaled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output as the model returns it: Granite divides it by its logits scaling, Gemma soft-caps it
        (``tanh(logits / cap) * cap``, op for op)."""
        if self.softcap:
            return torch.tanh(logits / self.softcap) * self.softcap
        return logits / self.logits_divisor if self.logits_divisor != 1.0 else logits


def unsupported(model: Any) -> str | None:
    """Why :class:`LlamaDecodeStep` does not reproduce ``model``'s decode step (None: it does, to be proved)."""
    model = language_model_of(model)
    decoder = decoder_of(model)
    config = model.config.get_text_config(decoder=True)
    layers = getattr(decoder, "layers", None)
    if not layers:
        return "its decoder has no layer list"
    names = {type(layer).__name__ for layer in layers}
    if len(names) != 1 or not names <= set(LAYER_CLASSES):
        return f"its layers are {', '.join(sorted(names))}, not one of {', '.join(LAYER_CLASSES)}"
    family = FAMILIES[names.pop()]
    activation = getattr(config, family.activation_key, None)
    if activation not in ACTIVATIONS:
        return f"its MLP activation is {activation!r}, not {' or '.join(map(repr, ACTIVATIONS))}"
    if getattr(config, "partial_rotary_factor", None) not in (None, 1.0):
        return f"RoPE turns {config.partial_rotary_factor} of each head's dims, not all"
    if getattr(config, "attn_logit_softcapping", None) and not family.attention_softcap:
        return "its attention scores are soft-capped"
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional"
    # eager: the same softmax attention (the proof compares them); a capping family needs it (SDPA drops the cap)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTENTION_NAME, "eager"):
        return f"its attention is {getattr(config, '_attn_implementation', None)!r}, not SDPA or eager"
    if getattr(model, "logits_soft_cap", None) or (getattr(config, "final_logit_softcapping", None) and not family.logit_softcap):
        return "its logits are soft-capped"
    return None


def _additive(mask: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """A boolean mask (or a dict of them) as eager attention takes it: 0 where attended, float32's lowest elsewhere."""
    if isinstance(mask, dict):
        return {kind: _additive(each) for kind, each in mask.items()}
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)


Step = Callable[..., torch.Tensor]  # (ids, positions, mask, cache, **attention keywords) -> logits [rows, vocab]


@torch.inference_mode()
def disagreement(step: LlamaDecodeStep, reference: Step, model: Any, *, split: bool) -> float:
    """The largest |logit difference| between ``step`` and the model's own decode step
    (``reference``), relative to the largest logit: one step of two rows at different positions,
    one with masked entries, over the same random cache; with ``split`` (the model's attention is
    ``pc_rag_sdpa``) also attending by extents (a CPU batch), and over KV read in place (windowless
    models: :meth:`LlamaDecodeStep.serves`). Each step writes the same column of the cache."""
    config = language_model_of(model).config.get_text_config(decoder=True)
    generator = torch.Generator().manual_seed(0)
    device = model.device
    buffer = KVBuffer.for_model(model, 12, batch=2)
    buffer.storage.copy_(torch.randn(buffer.storage.shape, generator=generator).to(buffer.storage.dtype))
    buffer.grow_to(10)
    buffer.fix(12, torch.tensor([10], device=device))
    ids = torch.randint(config.vocab_size, (2, 1), generator=generator).to(device)
    positions = torch.tensor([[10], [13]], device=device)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool, device=device)
    mask[1, ..., :3] = False
    mask[:, ..., 11] = False  # not written yet
    cases: list[dict[str, Any]] = [{}]
    if split:
        extents = row_extents.RowExtents((0, 3), 11, group=1)
        cases.append({"extents": extents})
        if not step.windowed:
            kv = torch.randn((*buffer.storage.shape[:2], buffer.storage.shape[3], 4, buffer.storage.shape[5]), generator=generator)
            kv = kv.to(device=device, dtype=buffer.storage.dtype)
            both = shared_attention.SharedPart(kv, torch.arange(4, device=device), slice(0, 2))
            # the second row alone also reads a module moved 5 positions on (its queries rotate back), under APE
            moved = shared_attention.SharedPart(kv.flip(3), torch.arange(4, 8, device=device), (1,), shift=5,
                                                temperature=1.25, log_scale=0.3)
            try:
                rotator = RopeRotator(model)
            except ValueError:  # not one set of frequencies: nothing read in place is moved (pc_rag.model.rope)
                rotator = None
            shared = shared_attention.SharedKV([both, moved] if rotator is not None else [both], heads_per_kv=step.heads // step.kv_heads,
                                               dtype=buffer.storage.dtype, rotator=rotator)
            cases += [{"shared": shared.for_queries(positions, (10, 13))},
                      {"shared": shared.for_queries(positions, (10, 13)), "extents": extents}]
    kinds = sorted({kind for kind in step.layer_types if kind is not None})
    if len(kinds) > 1:  # a mask per layer type (Gemma 3's windowed local layers): each layer must read its own
        windowed = mask.clone()
        windowed[0, ..., :6] = False
        by_type = {kind: windowed if "sliding" in kind else mask for kind in kinds}
        cases += [{"mask": by_type}] + ([{"mask": by_type, "extents": extents}] if split else [])
    keywords = {"extents": row_extents.KWARG, "shared": shared_attention.KWARG}
    worst = 0.0
    for case in cases:
        case = dict(case)
        case_mask = case.pop("mask", mask)
        if getattr(config, "_attn_implementation", None) == "eager":  # it adds its mask to the scores: additive, as pc-rag builds it
            case_mask = _additive(case_mask)
        expected = reference(ids, positions, case_mask, buffer.cache,
                             **{keywords[name]: value for name, value in case.items()}).float()
        got = step(ids, positions, case_mask, buffer.cache, **case).float()
        worst = max(worst, ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item())
    return worst


def written_step(model: Any, reference: Step, *, split: bool) -> LlamaDecodeStep | None:
    """The written-out decode step for ``model``, proved against its own step (``reference``,
    see :func:`disagreement`), or None (logged why) where it does not reproduce it."""
    why = unsupported(model)
    if why is None:
        step = LlamaDecodeStep(model)
        # proved on float32 inputs: on 8-bit ones (weights="int4-a8") the proof's random cache makes outliers a
        # block's 8 bits cannot hold (0.42 of the largest logit; decode KL 1.3-1.9e-3 on real prompts,
        # benchmarks/decode_fidelity.py), and the 8-bit kernels are checked exactly when they load (pc_rag.kernels.loader)
        activation_bits = step.fused.activation_bits if step.fused is not None else 32
        if step.fused is not None:
            step.fused.activation_bits = 32
        worst = disagreement(step, reference, model, split=split)
        if worst > TOLERANCE and step.fused is not None:
            logger.warning("the C decode step differed from the model's own by %.2e of the largest logit; tensor ops instead", worst)
            step.fused = None
            worst = disagreement(step, reference, model, split=split)
        if worst <= TOLERANCE:
            logger.info("decode steps run written out (%s; logits within %.1e of the model's own)", type(model).__name__, worst)
            if step.fused is not None:
                step.fused.activation_bits = activation_bits
            return step
        why = f"its logits differed from the model's own step by {worst:.2e} of the largest"
    logger.info("decode steps run through the model's own forward: %s", why)
    return None
