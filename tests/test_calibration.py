"""A model's calibration (``pc_rag.prefill.calibration``): the recovery setting ``check()`` found, kept in
``kv_dir`` and used by later engines over the same model that choose none; a record that is foreign,
altered or unrunnable is named and ignored."""

from __future__ import annotations

import json
import logging

import pytest

from pc_rag import PromptCache
from pc_rag.conformance import CheckReport, FidelityResult, PathResult
from pc_rag.prefill import calibration

STRONGER = FidelityResult("recompute=32, recompute_tail=8", 1.0, 0.01, {"recompute": 32, "recompute_tail": 8})


def report_recommending(*results: FidelityResult) -> CheckReport:
    """A check's report whose paths were exact and whose fidelity came out as ``results`` (defaults first, missing the bar)."""
    return CheckReport("tiny", paths=[PathResult("module in place, decode steps", 0.0)],
                       fidelity=[FidelityResult("defaults", 0.5, 0.3, {}), *results])


def messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "pc_rag.prefill.calibration")


def test_check_keeps_its_recommendation_for_engines_over_the_same_model(make_tiny, tokenizer, tmp_path, caplog):
    model = make_tiny("llama")
    with caplog.at_level(logging.INFO, logger="pc_rag.prefill.calibration"):
        engine = PromptCache(model, tokenizer, kv_dir=tmp_path)
        assert "no calibration for this model" in messages(caplog)
        report = engine.check()
    assert report.recommended is not None  # the tiny model meets the bar at some setting (its probe answers are flat)
    record = json.loads(calibration.record_path(tmp_path, engine.spec.fingerprint).read_text())
    assert record["setting"] == report.recommended and record["fingerprint"] == engine.spec.fingerprint
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pc_rag.prefill.calibration"):
        PromptCache(model, tokenizer, kv_dir=tmp_path)
    assert f"recovery from this model's calibration (check() on {record['measured']}" in messages(caplog)


def test_a_recorded_setting_is_used_unless_the_caller_chose_one(make_tiny, tokenizer, tmp_path, caplog):
    model = make_tiny("llama")
    defaults = PromptCache(model, tokenizer, kv_dir=tmp_path).recovery
    fingerprint = PromptCache(model, tokenizer).spec.fingerprint
    assert calibration.keep(tmp_path, fingerprint, report_recommending(STRONGER)) is not None
    calibrated = PromptCache(model, tokenizer, kv_dir=tmp_path).recovery
    assert (calibrated.head, calibrated.tail) == (32, 8) != (defaults.head, defaults.tail)
    with caplog.at_level(logging.INFO, logger="pc_rag.prefill.calibration"):
        chosen = PromptCache(model, tokenizer, kv_dir=tmp_path, recompute=4).recovery
    assert chosen.head == 4 and chosen.tail == defaults.tail
    assert "recovery as the caller chose (recompute=4)" in messages(caplog)
    assert PromptCache(model, tokenizer).recovery == defaults  # no kv_dir: nothing to read


def test_nothing_is_kept_without_a_setting_that_meets_the_bar_or_an_exact_check(tmp_path):
    missing = report_recommending(FidelityResult("recompute=32, recompute_tail=8", 0.5, 0.2, {"recompute": 32, "recompute_tail": 8}))
    assert missing.recommended is None and calibration.keep(tmp_path, "f" * 64, missing) is None
    inexact = report_recommending(STRONGER)
    inexact.paths.append(PathResult("batch rows sharing a moved module", 1.0))
    assert calibration.keep(tmp_path, "f" * 64, inexact) is None
    assert calibration.keep(None, "f" * 64, report_recommending(STRONGER)) is None
    assert not (tmp_path / calibration.FOLDER).exists()


@pytest.mark.parametrize("damage", ["another model's", "altered", "not json", "unrunnable"])
def test_a_record_that_does_not_check_out_is_named_and_the_defaults_run(make_tiny, tokenizer, tmp_path, caplog, damage):
    model = make_tiny("llama")
    defaults = PromptCache(model, tokenizer).recovery
    fingerprint = PromptCache(model, tokenizer).spec.fingerprint
    path = calibration.record_path(tmp_path, fingerprint)
    if damage == "another model's":  # measured on other weights, copied under this model's name
        written = calibration.keep(tmp_path, "0" * 64, report_recommending(STRONGER))
        path.write_bytes(written.read_bytes())
    elif damage == "altered":  # a setting changed by hand after it was measured
        calibration.keep(tmp_path, fingerprint, report_recommending(STRONGER))
        record = json.loads(path.read_text())
        record["settings"]["recompute"] = 64
        path.write_text(json.dumps(record))
    elif damage == "not json":
        path.parent.mkdir(parents=True)
        path.write_bytes(b"{\"format\": 1, \"fing")
    else:  # checks out, but names a setting no engine runs
        bad = FidelityResult("recompute=-3", 1.0, 0.01, {"recompute": -3})
        calibration.keep(tmp_path, fingerprint, report_recommending(bad))
    with caplog.at_level(logging.WARNING, logger="pc_rag.prefill.calibration"):
        engine = PromptCache(model, tokenizer, kv_dir=tmp_path)
    assert engine.recovery == defaults
    reason = {"another model's": "measured on another model", "altered": "checksum does not match", "not json": "unreadable",
              "unrunnable": "this engine cannot run it"}[damage]
    assert f"calibration record {path} ignored: " in messages(caplog) and reason in messages(caplog)
