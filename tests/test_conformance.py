"""``PromptCache.check()`` and ``pc-rag check``: the conformance self-test a user runs on their own
checkpoint, which says whether every path is exact and which recovery settings to use."""

from __future__ import annotations

from pc_rag import PromptCache
from pc_rag.cli import main
from pc_rag.forward import attention
from pc_rag.kernels import loader

from .test_architectures import tiny


def test_a_tiny_llama_is_exact_on_every_path_and_its_fidelity_is_measured(make_tiny, tokenizer):
    report = PromptCache(make_tiny("llama"), tokenizer).check()
    assert report.exact and {p.path for p in report.paths} >= {"module in place, decode steps", "batch rows sharing a moved module",
                                                              "a request joining running ones", "every token recomputed"}
    assert [f.setting for f in report.fidelity] == ["defaults", "recompute=32, recompute_tail=8", 'recovery="query", recovery_budget=0.3']
    assert all(0 <= f.agreement <= 1 and f.kl >= 0 for f in report.fidelity)
    assert "verdict: exact on every path it serves" in str(report)


def test_the_check_finds_a_path_that_is_not_exact(tokenizer, monkeypatch):
    """StableLM's layers drop attention keywords: were the guard to miss it (as it did before it
    existed), its batch rows and joining requests would read the wrong KV, and the check says so."""
    monkeypatch.setattr(attention, "receives_keywords", lambda *args: None)
    report = PromptCache(tiny("stablelm", len(tokenizer)), tokenizer).check(fidelity=False)
    failed = {p.path for p in report.paths if not p.passed}
    assert not report.exact and "batch rows sharing a moved module" in failed
    assert "NOT exact on every path" in str(report)


def test_pc_rag_check_prints_the_embedded_models_verdict(capsys):
    """The embedded model at its default int4 weights: every path exact on float32 inputs, and where the C
    step rounds them to 16 bits (AVX512-VNNI) that rounding measured on its own, within its own tolerance.
    Before: its paths were compared on 16-bit inputs, 2.7-3.5e-3 apart, and the check failed them."""
    assert main(["check", "--no-fidelity"]) == 0
    out = capsys.readouterr().out
    assert "ok   module in place, decode steps" in out and "verdict: exact on every path it serves" in out
    assert ("ok   decode steps on 16-bit inputs" in out) == bool(loader.library().a16_kernels(-1)), out


def test_a_model_whose_modules_cannot_move_is_checked_at_schema_positions(make_tiny, tokenizer):
    """Before: ``check()`` on GPT-2 (learned positions) raised the PromptCacheError that refuses
    movable documents, instead of checking the paths the model is served by."""
    report = PromptCache(make_tiny("gpt2"), tokenizer).check()
    paths = {p.path: p for p in report.paths}
    assert report.exact and not report.fidelity  # nothing is moved: no approximation to measure
    assert paths["full prefill = the model's own forward"].max_diff <= 1e-3
    assert paths["batch rows sharing a cached module"].max_diff <= 1e-3
    assert "refused when built" in paths["every token recomputed"].note
