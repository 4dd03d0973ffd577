"""16-bit KV buffers under a float32 model (``PromptCache(kv_dtype=)``): the C step reads and writes them as
the tensor ops do, module KV is held in them, an engine over them decodes in C, and a setting it cannot
serve is refused by name."""

from __future__ import annotations

import pytest
import torch

from pc_rag import PromptCache
from pc_rag.errors import PromptCacheError
from pc_rag.forward import row_extents, shared_attention
from pc_rag.kv.buffers import KVBuffer
from tests.conftest import drawn_away
from tests.test_fused_step import HEADS_OF_64, PARTS, in_c_and_in_ops, int4_engine, shared_kv
from tests.test_llama_step import answers, logprobs

SIXTEEN_BITS = [torch.bfloat16, torch.float16]


def random_cache(model, entries: int, dtype: torch.dtype, *, rows: int, seed: int) -> KVBuffer:
    """``rows`` rows of ``entries`` random entries in ``dtype``, fixed for a step that writes entry ``entries``."""
    buffer = KVBuffer.for_model(model, entries + 1, batch=rows, dtype=dtype)
    buffer.storage.copy_(torch.randn(buffer.storage.shape, generator=torch.Generator().manual_seed(seed)))
    buffer.grow_to(entries)
    buffer.fix(entries + 1, torch.tensor([entries]))
    return buffer


@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("heads", ["of 16", "of 64"])
@pytest.mark.parametrize("case", ["own entries", "by extents", "shared parts"])
def test_the_c_step_reads_and_writes_16_bit_kv_as_the_tensor_ops_do(make_tiny, tokenizer, dtype, heads, case, kernel_form):
    """The rows' own entries and the shared parts in 16 bits, widened exactly; the new entry rounded to
    nearest even, as torch rounds; the tensor ops' logits."""
    engine = int4_engine(make_tiny, tokenizer, "qwen2", **(HEADS_OF_64 if heads == "of 64" else {}))
    step, model = engine.forward.written_step, engine.model
    ids, positions = torch.tensor([[7], [11], [5]]), torch.tensor([[930], [925], [912]])
    attend = torch.ones(3, 1, 1, 21, dtype=torch.bool)
    attend[1, ..., :4] = False
    options, wide_options = {}, {}
    if case == "by extents":
        options["extents"] = wide_options["extents"] = row_extents.RowExtents((0, 3, 0), 21)
    if case == "shared parts":
        kv = shared_kv(model, step, PARTS)
        parts = [shared_attention.SharedPart(p.kv.to(dtype), p.positions, p.rows, p.shift, p.temperature, p.log_scale)
                 for p in kv.parts]
        wide_options["shared"] = kv.for_queries(positions, (912, 930))
        kv = shared_attention.SharedKV(parts, heads_per_kv=kv.heads_per_kv, dtype=torch.float32, rotator=kv.rotator)
        options["shared"] = kv.for_queries(positions, (912, 930))
    before = (step.fused.steps, step.fused.shared_steps)
    mine = random_cache(model, 20, dtype, rows=3, seed=5)
    got = step(ids, positions, attend, mine.cache, **options)
    assert (step.fused.steps, step.fused.shared_steps) == (before[0] + 1, before[1] + (case == "shared parts")), "it ran in C"
    fused, step.fused = step.fused, None
    try:
        theirs = random_cache(model, 20, dtype, rows=3, seed=5)
        expected = step(ids, positions, attend, theirs.cache, **options)
    finally:
        step.fused = fused
    scale = expected.abs().max().item()
    assert torch.allclose(got, expected, atol=1e-4 * scale)
    written = mine.storage[..., 20, :]
    assert not torch.equal(written, random_cache(model, 20, dtype, rows=3, seed=5).storage[..., 20, :]), "a new entry was written"
    assert torch.allclose(written.float(), theirs.storage[..., 20, :].float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-4)
    # layer 0's new key and value come from the embeddings alone: the C step's float32 ones, rounded as torch rounds them
    wide = random_cache(model, 20, torch.float32, rows=3, seed=5)
    wide.storage.copy_(random_cache(model, 20, dtype, rows=3, seed=5).storage)
    before = step.fused.steps
    step(ids, positions, attend, wide.cache, **wide_options)
    assert step.fused.steps == before + 1
    assert torch.equal(mine.storage[0, ..., 20, :], wide.storage[0, ..., 20, :].to(dtype))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_an_engine_on_16_bit_kv_decodes_in_c_as_its_tensor_ops_do(make_tiny, tokenizer, kv_dtype):
    """Alone, staggered (by extents) and three rows reading their documents shared: the buffers and the
    stored modules in 16 bits, every step in C, the tensor ops' tokens; and near the float32 engine's logprobs."""
    engine = PromptCache(drawn_away(make_tiny("llama")), tokenizer, weights="int4", recompute=0, attention_temperature=1.0,
                         attention_scale=1.0, kv_dtype=kv_dtype)
    step = engine.forward.written_step
    step.fused.activation_bits = 32  # float inputs, as the tensor ops' (int4_engine: 16-bit inputs have tests of their own)
    dtype = getattr(torch, kv_dtype)
    assert engine.spec.kv_dtype == dtype and engine.buffers.acquire(8).storage.dtype == dtype
    assert engine.spec.kv_bytes_per_token() * 2 == engine.spec.kv_bytes_per_token(torch.float32)
    in_c, in_ops = in_c_and_in_ops(engine)
    modules = [engine.store.get(key, count=False) for key in list(engine.store._memory)]
    assert engine.store.kv_dtype == dtype and modules and all(m.kv.dtype == dtype for m in modules), "module KV held in 16 bits"
    assert step.fused.steps > 0 and step.fused.shared_steps > 0, "decode steps (shared parts included) ran in C"
    for a, b in zip(in_c, in_ops):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 12
        assert torch.allclose(logprobs(a), logprobs(b), atol=1e-3)
    full = answers(int4_engine(make_tiny, tokenizer, "llama"), True)
    assert all(torch.allclose(logprobs(a)[:1], logprobs(b)[:1], atol=0.05) for a, b in zip(in_c, full))


def test_a_kv_dtype_it_cannot_serve_is_refused_by_name(make_tiny, tokenizer):
    with pytest.raises(PromptCacheError, match="kv_dtype must be one of float32, bfloat16, float16"):
        PromptCache(make_tiny("llama"), tokenizer, kv_dtype="int8")
    eager = drawn_away(make_tiny("llama", attn_implementation="eager"))
    with pytest.raises(PromptCacheError, match="needs pc-rag's attention"):
        PromptCache(eager, tokenizer, kv_dtype=torch.bfloat16)
    assert PromptCache(eager, tokenizer, kv_dtype="float32").spec.kv_dtype == torch.float32, "the model's own dtype: any attention"
