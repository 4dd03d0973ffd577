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

It serves only what it reproduces: the decoder layer classes in :data:`LAYER_CLASSES` (Llama,
Mistral, Qwen2: the same layer with or without biases), SiLU, SDPA, a decode step (one new token
per row) under one mask tensor, attending by extents and over shared KV as ``pc_rag_sdpa`` does
(shared KV only without a sliding window), and no forward hook on a module it does not call
(:meth:`LlamaDecodeStep.serves`). Everything else runs the model as before. :func:`written_step`
proves the step on the model itself before it is used: each case of :func:`disagreement` on the
same random cache must give the model's logits (:data:`TOLERANCE`), or the model keeps its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..kv.buffers import KVBuffer
from . import row_extents, shared_attention
from .attention import ATTENTION_NAME, CONFIG_WINDOW
from .decoder import decoder_of, language_model_of
from .fused_step import FusedStep
from .rotation import RopeRotator, signed_sin

logger = logging.getLogger(__name__)

# decoder layers whose decode step is the one written out here (transformers 5.x): RMSNorm before
# attention and MLP, q/k/v/o projections (biases optional: Qwen2), rotate-half RoPE, SiLU-gated MLP
LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
# largest |logit difference| against the model's own step, relative to the largest logit. The tensor ops
# agree bitwise; the C step (fused_step) sums in its own order, and the proof's random cache amplifies
# rounding: embeddings scaled by 1 + 1e-7 noise moved the embedded model's logits by 4.2e-5 of the largest
TOLERANCE = 1e-3


@dataclass(frozen=True)
class _Layer:
    """What one decoder layer's step reads."""

    attention_norm: torch.Tensor
    attention_eps: float
    q: Any
    k: Any
    v: Any
    o: Any
    mlp_norm: torch.Tensor
    mlp_eps: float
    gate: Any
    up: Any
    down: Any
    scaling: float
    attention: Any  # the layer's attention module (split attention reads its index)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm, op for op (float32 inside, the input's dtype out)."""
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
        self.head = self.model.get_output_embeddings()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.layers = [self._layer(layer) for layer in decoder.layers[: config.num_hidden_layers]]
        self.shared_steps = 0  # steps run that read shared KV (tests read it)
        # a layer that slides its window over keys (Mistral; Qwen2's sliding layers): shared KV, whose
        # masks follow the window the model hands its attention, is left to the model's own step
        self.windowed = bool(getattr(config, "sliding_window", None)) and any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ("sliding_attention",)) or any(
            getattr(layer.attention, CONFIG_WINDOW, None) for layer in self.layers)
        # the modules whose forward this step does not call (it calls the linear layers): a hook on
        # one (a steering vector, a probe added after the engine was built) sends steps back to the model
        self._unhooked = [decoder, self.embed, self.norm, self.model, *(
            part for layer in decoder.layers for part in (layer, layer.self_attn, layer.mlp, layer.input_layernorm,
                                                          layer.post_attention_layernorm))]
        # their hook tables (torch adds to them in place): one `any` over them a step, not ~300 attribute reads
        self._hook_tables = [table for module in self._unhooked for table in (module._forward_hooks, module._forward_pre_hooks)]
        # the whole step in one C call where the linear layers are pc-rag's blocks (None: tensor ops only)
        self.fused = FusedStep.build(self)

    def serves(self, shared: Any) -> bool:
        """Whether this step runs a decode step that reads ``shared`` KV (None: none) as the model
        would: not where a hook would be skipped, nor shared KV through a sliding window."""
        return not self.hooked and (shared is None or not self.windowed)

    @property
    def hooked(self) -> bool:
        """Whether a forward hook would be skipped by this step (then the model's own runs)."""
        return bool(torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks) or any(
            self._hook_tables)

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(
            layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
            layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
            mlp.gate_proj, mlp.up_proj, mlp.down_proj, attn.scaling, attn,
        )

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any,
                 extents: row_extents.RowExtents | None = None, shared: shared_attention.SharedStep | None = None) -> torch.Tensor:
        """Feed ``ids [rows, 1]`` at ``positions [rows, 1]``, their KV written into ``cache`` (a
        :class:`KVBuffer`'s, fixed for decoding) and attending over it under ``mask [rows, 1, 1,
        entries]``; ``extents``: each row attends within its own (a CPU batch, see
        :mod:`pc_rag.forward.row_extents`); ``shared``: and over KV read in place (split attention,
        :mod:`pc_rag.forward.shared_attention`; see :meth:`serves`). The next logits, ``[rows, vocab]``."""
        self.shared_steps += shared is not None
        if self.fused is not None:
            logits = self.fused(ids, positions, mask, cache, extents, shared)
            if logits is not None:
                return logits
        rows = ids.shape[0]
        hidden = self.embed(ids)  # [rows, 1, hidden]
        cos, sin = self.rotary(hidden, positions)
        cos, sin = cos[:, None], signed_sin(sin[:, None])  # [rows, 1, 1, dim]: every head
        group = self.heads // self.kv_heads
        for index, layer in enumerate(self.layers):
            x = _rms_norm(hidden, layer.attention_norm, layer.attention_eps)
            # [rows, heads, 1, dim] by a view: with one token, heads-major is the projection's own order
            q = layer.q(x).view(rows, self.heads, 1, -1)
            k = layer.k(x).view(rows, self.kv_heads, 1, -1)
            v = layer.v(x).view(rows, self.kv_heads, 1, -1)
            keys, values = cache.layers[index].update(_rotate(k, cos, sin), v)
            q = _rotate(q, cos, sin)
            if shared is not None:
                out = shared_attention.split_attention(layer.attention, q, keys, values, mask, layer.scaling, shared,
                                                       extents=extents)
            elif extents is not None:
                out = row_extents.attend(q, keys, values, mask, layer.scaling, extents)
            else:  # a key head's queries stacked as its query rows (transformers' pack_gqa): no key copies
                out = F.scaled_dot_product_attention(q.view(rows, self.kv_heads, group, -1), keys, values, attn_mask=mask,
                                                     scale=layer.scaling)
            out = out.reshape(rows, 1, -1)  # heads-major again, as o_proj reads them
            hidden = hidden + layer.o(out)
            x = _rms_norm(hidden, layer.mlp_norm, layer.mlp_eps)
            hidden = hidden + layer.down(F.silu(layer.gate(x)) * layer.up(x))
        hidden = _rms_norm(hidden, self.norm.weight, self.norm.variance_epsilon)
        return self.head(hidden)[:, -1]


def unsupported(model: Any) -> str | None:
    """Why :class:`LlamaDecodeStep` does not reproduce ``model``'s decode step (None: it does, to be proved)."""
    model = language_model_of(model)
    decoder = decoder_of(model)
    config = model.config.get_text_config(decoder=True)
    layers = getattr(decoder, "layers", None)
    if not layers:
        return "its decoder has no layer list"
    names = {type(layer).__name__ for layer in layers}
    if not names <= set(LAYER_CLASSES):
        return f"its layers are {', '.join(sorted(names))}, not {' or '.join(LAYER_CLASSES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"its MLP activation is {getattr(config, 'hidden_act', None)!r}, not 'silu'"
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTENTION_NAME):
        return f"its attention is {getattr(config, '_attn_implementation', None)!r}, not SDPA"
    if getattr(model, "logits_soft_cap", None) or getattr(config, "final_logit_softcapping", None):
        return "its logits are soft-capped"
    return None


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
    keywords = {"extents": row_extents.KWARG, "shared": shared_attention.KWARG}
    worst = 0.0
    for case in cases:
        expected = reference(ids, positions, mask, buffer.cache, **{keywords[name]: value for name, value in case.items()}).float()
        got = step(ids, positions, mask, buffer.cache, **case).float()
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
