"""Module KV persistence (safetensors + JSON manifest), fault detection, and the memory budget."""

import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from pc_rag import PML, PromptCache, PromptCacheError

SCHEMA = """<schema name="kb">
<system>Answer briefly.</system>
<user>
<module name="a">Alpha is the first letter of the Greek alphabet.</module>
<module name="b">Beta follows alpha; it is the second letter.</module>
<module name="c">Gamma is the third letter, written as a small hook.</module>
</user>
</schema>"""
PROMPT = PML('<prompt schema="kb"><a/><c/><user>Which letter is third?</user></prompt>')


def entry_files(kv_dir):
    return sorted(kv_dir.rglob("*.safetensors")), sorted(kv_dir.rglob("*.json"))


def test_a_new_process_loads_modules_instead_of_encoding(saved_model, tmp_path):
    kv_dir = tmp_path / "cache"
    first = PromptCache.from_pretrained(saved_model, kv_dir=kv_dir)
    first.add_schema(SCHEMA, progress=False)
    assert first.forward.passes == 4  # prefix + three modules
    expected = first.generate(PROMPT, max_new_tokens=6).token_ids
    code = textwrap.dedent(f"""
        import json
        from pc_rag import PML, PromptCache
        engine = PromptCache.from_pretrained({str(saved_model)!r}, kv_dir={str(kv_dir)!r})
        engine.add_schema({SCHEMA!r}, progress=False)
        passes = engine.forward.passes
        print(json.dumps({{"passes": passes, "loads": engine.store.disk_loads,
                           "tokens": engine.generate({PROMPT!r}, max_new_tokens=6).token_ids}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"passes": 0, "loads": 4, "tokens": expected}


@pytest.mark.parametrize("fault", ["truncate", "flip", "foreign", "garbage-manifest"])
def test_damaged_entries_are_detected_logged_and_reencoded(saved_model, tmp_path, caplog, fault):
    kv_dir = tmp_path / "cache"
    first = PromptCache.from_pretrained(saved_model, kv_dir=kv_dir)
    first.add_schema(SCHEMA, progress=False)
    expected = first.generate(PROMPT, max_new_tokens=6).token_ids
    data, manifests = entry_files(kv_dir)
    assert len(data) == len(manifests) == 4
    victim = data[0]
    manifest = victim.with_suffix(".json")
    if fault == "truncate":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif fault == "flip":
        blob = bytearray(victim.read_bytes())
        blob[-5] ^= 0xFF
        victim.write_bytes(bytes(blob))
    elif fault == "foreign":
        record = json.loads(manifest.read_text())
        record["fingerprint"] = "0" * 32
        manifest.write_text(json.dumps(record))
    else:
        manifest.write_text("{not json")
    second = PromptCache.from_pretrained(saved_model, kv_dir=kv_dir)
    with caplog.at_level(logging.WARNING, logger="pc_rag.kv.store"):
        second.add_schema(SCHEMA, progress=False)
    assert second.forward.passes == 1  # only the damaged entry is encoded again
    assert any("discarding cache entry" in r.message for r in caplog.records)
    assert second.generate(PROMPT, max_new_tokens=6).token_ids == expected
    assert len(entry_files(kv_dir)[0]) == 4  # rebuilt, nothing else lost


def test_entries_for_another_encoding_or_dtype_are_never_used(saved_model, tmp_path):
    kv_dir = tmp_path / "cache"
    PromptCache.from_pretrained(saved_model, kv_dir=kv_dir, encoding="shared_prefix").add_schema(SCHEMA, progress=False)
    isolated = PromptCache.from_pretrained(saved_model, kv_dir=kv_dir, encoding="isolated")
    isolated.add_schema(SCHEMA, progress=False)
    assert isolated.forward.passes > 0 and isolated.store.disk_loads == 0
    half = PromptCache.from_pretrained(saved_model, kv_dir=kv_dir, dtype=torch.bfloat16)
    half.add_schema(SCHEMA, progress=False)
    assert half.forward.passes > 0 and half.store.disk_loads == 0


def test_no_temporary_files_are_left_behind(saved_model, tmp_path):
    kv_dir = tmp_path / "cache"
    PromptCache.from_pretrained(saved_model, kv_dir=kv_dir).add_schema(SCHEMA, progress=False)
    assert not [p for p in kv_dir.rglob("*") if p.name.endswith(".tmp")]


def test_memory_budget_evicts_to_disk_and_serving_still_matches(make_tiny, tokenizer):
    reference = PromptCache(make_tiny("llama"), tokenizer)
    reference.add_schema(SCHEMA, progress=False)
    # room for what PROMPT imports (prefix, a, c), not for the whole schema: b's turn forces evictions
    budget = sum(m.nbytes for m in reference.store._memory.values()) - min(m.nbytes for m in reference.store._memory.values()) // 2
    engine = PromptCache(make_tiny("llama"), tokenizer, memory_budget=budget)
    engine.add_schema(SCHEMA, progress=False)
    assert engine.store.memory_bytes <= budget
    for prompt in (PROMPT, PML('<prompt schema="kb"><b/><user>Second?</user></prompt>'), PROMPT):
        assert engine.generate(prompt, max_new_tokens=5).token_ids == reference.generate(prompt, max_new_tokens=5).token_ids
        assert engine.store.memory_bytes <= budget
    assert engine.store.disk_loads > 0


def test_clear_memory_keeps_everything_on_disk(saved_model, tmp_path):
    engine = PromptCache.from_pretrained(saved_model, kv_dir=tmp_path / "cache", recompute=0)
    engine.add_schema(SCHEMA, progress=False)
    expected = engine.generate(PROMPT, max_new_tokens=6).token_ids
    encoded = engine.forward.encoded
    assert engine.store.clear_memory() > 0 and engine.store.memory_bytes == 0
    assert engine.generate(PROMPT, max_new_tokens=6).token_ids == expected
    assert engine.store.disk_loads == 3 and engine.forward.encoded == encoded  # prefix, a, c: loaded, not encoded
    assert PromptCache.from_pretrained(saved_model).store.clear_memory() == 0  # no disk tier: nothing dropped


def test_store_dtype_keeps_kv_in_lower_precision(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama"), tokenizer, store_dtype=torch.bfloat16)
    engine.add_schema(SCHEMA, progress=False)
    assert all(m.kv.dtype == torch.bfloat16 for m in engine.store._memory.values())
    full = engine.next_token_logits(PROMPT, use_cache=False)
    cached = engine.next_token_logits(PROMPT)
    assert cached.dtype == torch.float32 and (cached - full).abs().max().item() < 0.5


def test_request_over_the_memory_budget_is_refused_before_any_work(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama"), tokenizer, memory_budget=1024)  # smaller than any module
    engine.add_schema(SCHEMA, progress=False)
    passes = engine.forward.passes
    with pytest.raises(PromptCacheError, match="more than memory_budget"):
        engine.generate(PROMPT, max_new_tokens=2)
    assert engine.forward.passes == passes
    assert engine.generate(PROMPT, max_new_tokens=2, use_cache=False).stats.cached_tokens == 0  # the baseline needs no store


def test_cache_dir_is_transformers_download_cache_not_the_kv_folder(make_tiny, tokenizer, tmp_path):
    """transformers' cache_dir means the download cache: from_pretrained hands it to transformers,
    and the engine's module KV folder is kv_dir alone (the old alias is gone)."""
    with pytest.raises(TypeError, match="cache_dir"):
        PromptCache(make_tiny("llama"), tokenizer, cache_dir=tmp_path / "old")  # type: ignore[call-arg]
    engine = PromptCache.from_pretrained(cache_dir=str(tmp_path / "downloads"))
    assert engine.kv_dir is None and not (tmp_path / "downloads" / "modules").exists()
