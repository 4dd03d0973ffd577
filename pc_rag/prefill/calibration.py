"""The recovery setting ``check()`` found for a model, kept in ``kv_dir`` for the engines over the same weights.

``engine.check()`` measures moved-module fidelity on its probe set under a few settings and names the
cheapest that meets its bar (:attr:`pc_rag.conformance.CheckReport.recommended`). Where the engine has
a ``kv_dir``, :func:`keep` writes that setting there, under the model's fingerprint (weights,
tokenizer, dtype, positions, chat markers, versions: :class:`pc_rag.model.spec.ModelSpec`). An
engine built later over the same model and ``kv_dir``, whose caller chose no recovery setting,
recovers as recorded (:func:`recovery`). One log line says which settings an engine runs and why:
the caller's, the record's, or pc-rag's defaults.

The record is shared data that someone else may have written: it is replaced whole (an atomic
rename), and read back only where its format, fingerprint and checksum are right and its
settings are the ones ``check()`` tries. A record that fails any of these is named in a warning
and ignored, and the defaults run. A setting the model cannot run is ignored the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ..atomic import atomic_write
from ..errors import PromptCacheError
from ..paths import expand
from .recovery import Recovery, configure_recovery

logger = logging.getLogger(__name__)

FORMAT = 1
FOLDER = "calibration"
# the settings a record may hold (the engine's keyword arguments), with the types each takes
SETTINGS: dict[str, tuple[type, ...]] = {"recovery": (str,), "recovery_budget": (int, float), "recompute": (int,),
                                         "recompute_tail": (int,)}


def record_path(kv_dir: str | os.PathLike, fingerprint: str) -> Path:
    """Where the calibration of the model with ``fingerprint`` is kept under ``kv_dir``."""
    return expand(kv_dir) / FOLDER / f"{fingerprint[:32]}.json"


def _checksum(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def keep(kv_dir: str | os.PathLike | None, fingerprint: str, report: Any) -> Path | None:
    """Record ``report``'s recommended setting (a :class:`~pc_rag.conformance.CheckReport`) for the model
    with ``fingerprint`` in ``kv_dir``. Nothing is recorded without a ``kv_dir``, without fidelity
    measured, or where a path was not exact or no setting met the bar. Returns where it was written."""
    if kv_dir is None or not report.exact or report.recommended is None:
        return None
    chosen = next(f for f in report.fidelity if f.setting == report.recommended)
    payload = {"format": FORMAT, "fingerprint": fingerprint, "setting": chosen.setting, "settings": dict(chosen.settings),
               "agreement": chosen.agreement, "kl": chosen.kl, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = record_path(kv_dir, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({**payload, "checksum": _checksum(payload)}, indent=1).encode())
    logger.info("calibration kept for this model in %s: %s", path, chosen.setting)
    return path


def recorded(kv_dir: str | os.PathLike, fingerprint: str) -> dict[str, Any] | None:
    """The record for ``fingerprint`` in ``kv_dir`` where there is one and it checks out; None otherwise
    (a record that does not check out is named in a warning)."""
    path = record_path(kv_dir, fingerprint)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        logger.warning("calibration record %s ignored: unreadable (%s)", path, err)
        return None
    problem = _problem(record, fingerprint)
    if problem is not None:
        logger.warning("calibration record %s ignored: %s", path, problem)
        return None
    return record


def _problem(record: Any, fingerprint: str) -> str | None:
    """What is wrong with ``record`` for the model with ``fingerprint`` (None: nothing)."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return f"not a format-{FORMAT} calibration record"
    if record.get("fingerprint") != fingerprint:
        return "it was measured on another model"
    payload = {name: value for name, value in record.items() if name != "checksum"}
    if record.get("checksum") != _checksum(payload):
        return "its checksum does not match its contents"
    if not all(isinstance(record.get(name), str) for name in ("setting", "measured")) or not all(
            isinstance(record.get(name), (int, float)) and not isinstance(record.get(name), bool) for name in ("agreement", "kl")):
        return "its setting, date or measurements are missing"
    settings = record.get("settings")
    if not isinstance(settings, dict) or any(name not in SETTINGS or isinstance(value, bool) or not isinstance(value, SETTINGS[name])
                                             for name, value in settings.items()):
        return f"its settings are not among {', '.join(SETTINGS)}"
    return None


def recovery(spec: Any, kv_dir: str | os.PathLike | None, *, asked: dict[str, Any], temperature: float | None,
             scale: float | None) -> Recovery:
    """The engine's recovery: the caller's settings (``asked``: the engine's ``recovery``, ``recovery_budget``,
    ``recompute`` and ``recompute_tail``, None where not given) where any was given; else this model's
    record in ``kv_dir`` where it checks out and the model runs it; else pc-rag's defaults."""
    def configured(settings: dict[str, Any]) -> Recovery:
        return configure_recovery(spec, strategy=settings.get("recovery"), budget=settings.get("recovery_budget"),
                                  recompute=settings.get("recompute"), recompute_tail=settings.get("recompute_tail"),
                                  temperature=temperature, scale=scale)

    given = {name: value for name, value in asked.items() if value is not None}
    if given or kv_dir is None:
        if given and kv_dir is not None:
            logger.info("recovery as the caller chose (%s), not from a calibration", _listed(given))
        return configured(given)
    record = recorded(kv_dir, spec.fingerprint)
    if record is None:
        logger.info("no calibration for this model in %s: pc-rag's default recovery (engine.check() records one)", kv_dir)
        return configured({})
    try:
        chosen = configured(record["settings"])
    except PromptCacheError as err:
        logger.warning("calibration record %s ignored: this engine cannot run it (%s)", record_path(kv_dir, spec.fingerprint), err)
        return configured({})
    logger.info("recovery from this model's calibration (check() on %s: first token = full prefill on %.1f%%, KL %.4f): %s",
                record["measured"], 100 * record["agreement"], record["kl"], record["setting"])
    return chosen


def _listed(settings: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in settings.items())
