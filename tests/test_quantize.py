"""Module KV at rest in 8 and 4 bits (``kv_quantization``): the packing's error bound, entries
through memory, disk and a real Redis, the memory budget counting stored bytes, and quantized and
full-precision entries never mixing."""

from __future__ import annotations

import pytest
import torch

from pc_rag import PromptCache, PromptCacheError, build_prompt
from pc_rag.forward.rotation import rotate_in_place, rotate_with
from pc_rag.kv.buffers import ModuleKV
from pc_rag.kv.quantize import SCHEMES, QuantizedModuleKV, quantize
from pc_rag.kv.records import KVShape, deserialize, serialize

DOCS = [
    "The cathedral bell was cast in 1822 and rings every hour from the north tower of the old town square.",
    "Lighthouse keepers logged the weather at dawn and at dusk, and the logbooks survive from 1851 onwards.",
    "The river freezes most winters, and skaters cross it in January when the ice is thick enough to hold.",
]
QUESTION = "When was the bell cast?"


def _bound(module: QuantizedModuleKV) -> torch.Tensor:
    """Per element, half the stored step of its group: the scheme's promise."""
    scheme, tokens, head_dim = module.scheme, len(module), module.head_dim
    _, per_group = scheme.key_groups(tokens)
    keys = module.key_scale.float().repeat_interleave(per_group, dim=2)[:, :, :tokens]
    values = module.value_scale.float().repeat_interleave(scheme.value_group(head_dim), dim=-1)
    return torch.stack([keys, values], dim=1) / 2


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("tokens", [1, 5, 64, 143, 300])
def test_dequantize_of_quantize_is_within_half_a_step(scheme, tokens):
    torch.manual_seed(tokens)
    kv = torch.randn(3, 2, 2, tokens, 64) * 2 + 3
    kv[:, 0, :, :, 7] *= 50  # an outlier key channel: per-channel ranges keep it from costing the others
    kv[:, 1, :, 0] = 0.0  # a constant group (zero range)
    module = quantize(kv, torch.arange(tokens), SCHEMES[scheme])
    error = (module.read() - kv).abs()
    assert (error <= _bound(module) * (1 + 1e-5) + 1e-6).all()
    # the outlier channel does not widen its neighbours' steps
    assert module.key_scale[:, :, :, 8].float().max() < module.key_scale[:, :, :, 7].float().min()
    # any slice reads what the whole reads there (group boundaries inside the slice)
    start = tokens // 3
    assert torch.equal(module.read(start, tokens), module.read()[:, :, :, start:])


def test_packed_sizes_meet_the_targets_on_the_embedded_models_shape():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32 (46,080 bytes of KV per token)
    full = 30 * 2 * 3 * 64 * 4 + 8
    for tokens in (143, 300, 1024):
        int8 = SCHEMES["int8"].bytes_per_token(30, 3, 64, tokens) / full
        int4 = SCHEMES["int4"].bytes_per_token(30, 3, 64, tokens) / full
        assert int8 <= 0.27 and int4 <= 0.16, (tokens, int8, int4)
    kv = torch.randn(30, 2, 3, 143, 64)
    module = quantize(kv, torch.arange(143), SCHEMES["int4"])
    assert module.nbytes == pytest.approx(SCHEMES["int4"].bytes_per_token(30, 3, 64, 143) * 143)


def _dequantized_and_rotated(cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> tuple:
    """A quantized module's entries 5-35 dequantized into a buffer and rotated there, the same
    entries read and rotated into a fresh tensor, and the entries as read."""
    torch.manual_seed(0)
    module = quantize(torch.randn(2, 2, 2, 40, 16), torch.arange(40), SCHEMES["int8"])
    expected = torch.empty(2, 2, 30, 16)
    rotate_with(expected, module.read(5, 35)[:, 0], cos, sin, interleaved=interleaved)
    out = torch.zeros(2, 2, 2, 30, 16)
    module.read_into(out, 5, 35)
    rotate_in_place(out[:, 0], cos, sin, interleaved=interleaved)
    return out, expected, module.read(5, 35)


@pytest.mark.parametrize("interleaved", [False, True])
def test_dequantizing_into_a_buffer_then_rotating_equals_rotating_the_dequantized_keys(interleaved):
    angles = torch.arange(8, dtype=torch.float32) * 0.3
    angles = angles.repeat_interleave(2) if interleaved else torch.cat([angles, angles])
    out, expected, read = _dequantized_and_rotated(angles.cos(), angles.sin(), interleaved)
    assert torch.allclose(out[:, 0], expected, atol=1e-6)
    assert torch.equal(out[:, 1], read[:, 1])


def test_rotating_in_place_with_frequencies_per_layer_rotates_each_layer_by_its_own():
    """Gemma 3's local and global layers, or a layer without RoPE: cos/sin ``[layers, 1, 1, rotary_dim]``."""
    angles = torch.stack([torch.arange(8, dtype=torch.float32) * 0.3, torch.zeros(8)])  # layer 1: no rotation
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None, None], torch.cat([angles, angles], -1).sin()[:, None, None]
    out, expected, read = _dequantized_and_rotated(cos, sin)
    assert torch.allclose(out[:, 0], expected, atol=1e-6)
    assert torch.equal(out[1, 0], read[1, 0])  # the layer without RoPE kept its keys
    assert not torch.allclose(out[0, 0], read[0, 0])


def test_payloads_round_trip_and_foreign_precision_is_refused():
    kv = torch.randn(2, 2, 2, 10, 16)
    positions = torch.arange(10)
    int8 = quantize(kv, positions, SCHEMES["int8"])
    int4 = quantize(kv, positions, SCHEMES["int4"])
    from safetensors.torch import load

    back = deserialize(load(serialize(int4)))
    assert isinstance(back, QuantizedModuleKV) and back.scheme == SCHEMES["int4"]
    assert torch.equal(back.read(), int4.read())
    shape8 = KVShape(2, 2, 16, torch.float32, SCHEMES["int8"])
    assert shape8.problem(int8, range(10)) is None
    assert "int4" in shape8.problem(int4, range(10))
    assert "full precision" in shape8.problem(ModuleKV(kv, positions), range(10))
    assert "int8" in KVShape(2, 2, 16, torch.float32).problem(int8, range(10))
    assert shape8.problem(int8, range(1, 11)) == "positions other than this module's"


def test_unknown_kv_quantization_is_a_typed_error(make_engine):
    with pytest.raises(PromptCacheError, match="kv_quantization must be None, 'int8' or 'int4'"):
        make_engine(kv_quantization="int2")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_engine_serves_from_memory_disk_and_redis_alike(make_tiny, tokenizer, tmp_path, redis_server, scheme):
    model = make_tiny("llama")
    settings = dict(recompute=0, attention_temperature=1.0, attention_scale=1.0, kv_quantization=scheme)
    writer = PromptCache(model, tokenizer, kv_dir=tmp_path / "kv", remote_store=redis_server.url, **settings)
    names = writer.add_documents(DOCS, progress=False)
    prompt = build_prompt(QUESTION, names)
    from_memory = writer.next_token_logits(prompt)
    stats = writer.store_stats()
    full_bytes = writer.spec.kv_bytes_per_token()
    assert 0 < stats["bytes_per_token"] < full_bytes * (0.5 if scheme == "int8" else 0.35)  # tiny head_dim: ranges weigh more
    writer.store.clear_memory()
    assert torch.equal(writer.next_token_logits(prompt), from_memory)
    assert writer.store_stats()["hits_disk"] == len(DOCS) + 1  # the documents and the system prompt
    replica = PromptCache(model, tokenizer, remote_store=redis_server.url, **settings)
    assert torch.equal(replica.next_token_logits(prompt), from_memory)
    assert replica.store_stats()["hits_remote"] >= len(DOCS) and replica.store_stats()["encoded"] == 0
    # against full precision: the quantized cache answers close to it
    exact = PromptCache(model, tokenizer, recompute=0, attention_temperature=1.0, attention_scale=1.0)
    exact.add_documents(DOCS, progress=False)
    reference = exact.next_token_logits(prompt)
    assert not torch.equal(reference, from_memory)
    assert torch.allclose(reference.softmax(-1), from_memory.softmax(-1), atol=0.02 if scheme == "int8" else 0.05)


def test_quantized_and_full_precision_entries_never_mix(make_tiny, tokenizer, tmp_path, redis_server):
    model = make_tiny("llama")
    engines = {q: PromptCache(model, tokenizer, kv_dir=tmp_path / "kv", remote_store=redis_server.url, kv_quantization=q)
               for q in (None, "int8", "int4")}
    assert len({e.fingerprint for e in engines.values()}) == 3
    engines[None].add_documents(DOCS, progress=False)
    for q in ("int8", "int4"):  # same folder, same Redis: nothing of the full-precision engine is served here
        engine = engines[q]
        engine.sync_documents()
        names = engine.add_documents(DOCS, progress=False)
        engine.next_token_logits(build_prompt(QUESTION, names))
        stats = engine.store_stats()
        assert stats["encoded"] >= len(DOCS) and stats["hits_disk"] == 0 and stats["hits_remote"] == 0


def test_a_foreign_precision_payload_under_this_engines_key_is_rejected_and_reencoded(make_tiny, tokenizer, tmp_path, caplog):
    model = make_tiny("llama")
    engine = PromptCache(model, tokenizer, kv_dir=tmp_path / "kv", kv_quantization="int8")
    names = engine.add_documents(DOCS[:1], progress=False)
    key = engine.registry.snapshot().schemas["docs"].keys[names[0]]
    stored = engine.store.get(key)
    # an int4 payload written where this engine's int8 entry is (well-formed, good checksum)
    engine.store.disk.save(key, quantize(stored.read(), stored.positions, SCHEMES["int4"]), {})
    engine.store.clear_memory()
    engine.store._memory.clear()
    encoded = engine.store_stats()["encoded"]
    engine.next_token_logits(build_prompt(QUESTION, names))
    assert engine.store_stats()["encoded"] == encoded + 1
    assert "int4 where this engine stores int8" in caplog.text


def test_a_memory_budget_holds_the_promised_number_of_quantized_modules(make_tiny, tokenizer):
    model = make_tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)  # head_dim 64
    # passages of ~130 tokens, as retrieval corpora hold (per-group key ranges weigh more on a module of a few tokens)
    texts = [" ".join(f"Record {i:02d}.{j}: the harbour master noted ship number {i * 7 + j} arriving with grain and timber."
                      for j in range(6)) for i in range(40)]
    probe = PromptCache(model, tokenizer)
    (name,) = probe.add_documents(texts[:1], progress=False)
    budget = 5 * probe.store.get(probe.registry.snapshot().schemas["docs"].keys[name]).nbytes
    held = {}
    for q in (None, "int8", "int4"):
        engine = PromptCache(model, tokenizer, kv_quantization=q, memory_budget=budget)
        engine.add_documents(texts, progress=False)
        assert engine.store.memory_bytes <= budget
        held[q] = len(engine.store._memory)
    assert 4 <= held[None] <= 5
    assert held["int8"] >= 3.5 * held[None]  # ~3.8x at head_dim 64: codes a quarter, ranges the rest
    assert held["int4"] >= 6 * held[None]
