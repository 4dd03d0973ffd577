"""The decode step in one C call (``pc_rag.forward.fused_step``) for models on pc-rag's block
kernels: the tensor ops' answers on every path it serves, the KV written where the model writes it,
and never used where it would skip something (a hook) or read stale weights."""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch

from pc_rag import PromptCache
from pc_rag.errors import PromptCacheError
from pc_rag.forward import row_extents, shared_attention
from pc_rag.forward.llama_step import disagreement
from pc_rag.forward.rotation import RopeRotator
from pc_rag.kernels import loader
from pc_rag.kv.buffers import KVBuffer
from pc_rag.prompt.documents import build_prompt
from pc_rag.weights import blocks
from tests.conftest import avx2_float_kernels, drawn_away, sixteen_bit_inputs_here
from tests.test_llama_step import DOCUMENTS, answers, logprobs


def int4_engine(make_tiny, tokenizer, arch: str = "llama", weights: str = "int4", inputs: int = 32, **overrides) -> PromptCache:
    """A tiny model on the block kernels. Its C step multiplies float32 inputs unless ``inputs`` says
    otherwise: the tests that hold it to the tensor ops' answers check the step, not the inputs' rounding
    (weights="int4" rounds them to 16 bits on AVX512-VNNI: tests below)."""
    engine = PromptCache(drawn_away(make_tiny(arch, **overrides)), tokenizer, weights=weights, recompute=0, attention_temperature=1.0,
                         attention_scale=1.0)
    fused = engine.forward.written_step.fused if engine.forward.written_step is not None else None
    if fused is not None and weights == "int4":
        fused.activation_bits = inputs
    return engine


# heads of 64 with 3 query heads a key head, as the embedded model's: the AVX-512 attention's shape (wide_kernels.c)
HEADS_OF_64 = {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1}


# qwen2: biases on q, k and v; qwen3: queries and keys normed per head; olmo2: over the whole projection, and norms
# after attention and the MLP, none before; granite: embeddings, residual branches and logits scaled; gemma3: norms of
# 1 + weight before and after both, GELU (tanh), RoPE frequencies and a mask (an 8-token window) per layer type;
# phi3: q, k and v one product, gate and up another (their rows read in place); gemma2: attention scores soft-capped
# (a cap low enough to bend them), eager attention's additive masks; smollm3: a layer without RoPE
CAPPED = {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "olmo2", "granite", "gemma3", "phi3", "gemma2", "smollm3"])
def test_the_c_step_answers_as_the_tensor_ops_do(make_tiny, tokenizer, arch, kernel_form):
    engine = int4_engine(make_tiny, tokenizer, arch, **(CAPPED if arch == "gemma2" else {}))
    step = engine.forward.written_step
    fused = step.fused
    assert fused is not None, "blocks on the kernels decode in C"
    assert disagreement(step, engine.forward._model_step, engine.model, split=engine.spec.split) < 1e-5
    in_c, in_ops = in_c_and_in_ops(engine)  # alone, staggered (by extents), and three rows reading shared KV
    assert fused.steps > 0, "decode steps ran in C"
    assert fused.shared_steps > 0 or step.windowed, "the batch over the same documents read them shared, in C"
    for a, b in zip(in_c, in_ops):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 12
        assert torch.allclose(logprobs(a), logprobs(b), atol=1e-4)


def in_c_and_in_ops(engine: PromptCache) -> tuple[list, list]:
    """The greedy answers of ``test_llama_step.answers`` with the C step, then with the tensor ops."""
    step = engine.forward.written_step
    in_c = answers(engine, True)
    fused, step.fused = step.fused, None
    try:
        return in_c, answers(engine, True)
    finally:
        step.fused = fused


@pytest.mark.parametrize("head_dim,kv_heads", [(128, 2), (256, 1)], ids=["128-grouped", "256-multi-query"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_the_c_step_serves_heads_of_128_and_256(make_tiny, tokenizer, arch, head_dim, kv_heads):
    """Heads as Qwen3 (128) and Gemma 3 270M (256, one key head) hold them: the model's own logits, and its tokens."""
    engine = int4_engine(make_tiny, tokenizer, arch, head_dim=head_dim, num_key_value_heads=kv_heads)
    step = engine.forward.written_step
    assert step is not None and step.fused is not None and step.fused.head_dim == head_dim
    assert disagreement(step, engine.forward._model_step, engine.model, split=True) < 1e-5
    ids = engine.add_documents(DOCUMENTS, progress=False)
    prompt = build_prompt("Who won?", ids)
    in_c = engine.generate(prompt, max_new_tokens=8)
    assert step.fused.steps > 0
    engine.forward.written_step = None
    try:
        own = engine.generate(prompt, max_new_tokens=8)
    finally:
        engine.forward.written_step = step
    assert in_c.token_ids == own.token_ids


def random_cache(model, entries: int, *, fixed: bool, rows: int = 1, room: int = 4, seed: int = 3) -> KVBuffer:
    """``rows`` rows of ``entries`` random entries in a buffer of ``entries + room``; ``fixed``: for a
    step that writes entry ``entries``."""
    buffer = KVBuffer.for_model(model, entries + room, batch=rows)
    buffer.storage.copy_(torch.randn(buffer.storage.shape, generator=torch.Generator().manual_seed(seed)))
    buffer.grow_to(entries)
    if fixed:
        buffer.fix(entries + room, torch.tensor([entries]))
    return buffer


@pytest.mark.parametrize("mask", ["none", "bool", "additive", "nothing attended"])
def test_a_growing_cache_gets_the_new_entry_where_the_model_puts_it(make_tiny, tokenizer, mask):
    engine = int4_engine(make_tiny, tokenizer)
    step, model = engine.forward.written_step, engine.model
    ids, positions = torch.tensor([[7]]), torch.tensor([[9]])
    attend = torch.ones(1, 1, 1, 10, dtype=torch.bool)
    attend[..., 2:4] = False
    masks = {"none": None, "bool": attend, "additive": torch.zeros(1, 1, 1, 10).masked_fill(~attend, torch.finfo(torch.float32).min),
             "nothing attended": torch.zeros(1, 1, 1, 10, dtype=torch.bool)}  # SDPA: zeros, not NaN
    mine, theirs = random_cache(model, 9, fixed=False), random_cache(model, 9, fixed=False)
    before = step.fused.steps
    got = step(ids, positions, masks[mask], mine.cache)
    expected = engine.forward._model_step(ids, positions, masks[mask], theirs.cache)
    assert step.fused.steps == before + 1
    assert len(mine) == len(theirs) == 10
    assert torch.allclose(mine.storage, theirs.storage, atol=1e-5)  # the new column (rotated key, value) and nothing else
    assert got.isfinite().all() and torch.allclose(got, expected, atol=1e-4 * expected.abs().max().item())


def test_a_hook_on_a_linear_layer_sends_steps_to_the_tensor_ops(make_tiny, tokenizer):
    engine = int4_engine(make_tiny, tokenizer)
    step, model = engine.forward.written_step, engine.model
    ids, positions = torch.tensor([[7]]), torch.tensor([[9]])
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda module, args, output: output + 1.0)
    try:
        before = step.fused.steps
        got = step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
        expected = engine.forward._model_step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    finally:
        handle.remove()
    assert step.fused.steps == before  # C would have skipped the hook
    unhooked = step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    assert step.fused.steps == before + 1
    scale = expected.abs().max().item()
    assert torch.allclose(got, expected, atol=1e-5 * scale) and not torch.allclose(unhooked, expected, atol=1e-2 * scale)


def test_weights_changed_in_place_are_read_as_they_are_and_replaced_ones_are_not_read(make_tiny, tokenizer):
    engine = int4_engine(make_tiny, tokenizer)
    step, model = engine.forward.written_step, engine.model
    ids, positions = torch.tensor([[7]]), torch.tensor([[9]])
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.scales.mul_(3.0)  # as load_state_dict copies into place
    got = step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    expected = engine.forward._model_step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    assert torch.allclose(got, expected, atol=1e-4 * expected.abs().max().item())
    before = step.fused.steps
    model.to(torch.float64)  # new tensors: the C step's pointers are stale, and the layers refuse the cast
    with pytest.raises(PromptCacheError, match="moved or cast"):
        step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    assert step.fused.steps == before


@pytest.mark.parametrize("name", ["values", "scales", "minimums", "bias"])
def test_a_weight_tensor_replaced_by_another_is_read_from_the_new_one(make_tiny, tokenizer, name):
    """The C step holds the layers' addresses; a tensor assigned in place of one (same dtype, same
    device) is read at its own: the step rebuilds them when any BlockLinear's tensors were replaced."""
    engine = int4_engine(make_tiny, tokenizer, "qwen2")  # qwen2: q, k and v have biases
    step, model = engine.forward.written_step, engine.model
    ids, positions = torch.tensor([[7]]), torch.tensor([[9]])
    unchanged = step(ids, positions, None, random_cache(model, 9, fixed=True).cache)  # the addresses read
    layer = model.model.layers[1].self_attn.q_proj
    old = getattr(layer, name)  # kept alive: a stale address reads the old values, not freed memory
    new = old ^ 0x11111111 if name == "values" else old * 3 + 0.5
    setattr(layer, name, torch.nn.Parameter(new, requires_grad=False) if name == "bias" else new)
    before = step.fused.steps
    got = step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    expected = engine.forward._model_step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    assert step.fused.steps == before + 1 and old is not getattr(layer, name)
    scale = expected.abs().max().item()  # the tensor ops (q, k and v joined in one product) read the new tensor too
    assert torch.allclose(got, expected, atol=1e-4 * scale) and not torch.allclose(got, unchanged, atol=1e-2 * scale)


@pytest.mark.parametrize("arch, norm", [("llama", "input_layernorm"), ("qwen3", "self_attn.q_norm"),
                                        ("olmo2", "post_feedforward_layernorm")])
@pytest.mark.parametrize("in_c", [True, False])
def test_a_norm_weight_replaced_by_another_parameter_is_read_from_the_new_one(make_tiny, tokenizer, arch, norm, in_c):
    """The step describes each layer's norms by their weights when it is built; a Parameter assigned in
    place of one (``module.weight = Parameter(...)``, ``load_state_dict(assign=True)``) is a new tensor,
    which the C step and the tensor ops read from the next step on, as the model's own forward does."""
    engine = int4_engine(make_tiny, tokenizer, arch)
    step, model = engine.forward.written_step, engine.model
    if not in_c:
        step.fused = None
    ids, positions = torch.tensor([[7]]), torch.tensor([[9]])
    unchanged = step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    in_c_before = step.fused.steps if in_c else None
    module = model.model.layers[1].get_submodule(norm)
    old = module.weight  # kept alive: a stale address would read the old values, not freed memory
    module.weight = torch.nn.Parameter(old.detach() * 3 + 0.5, requires_grad=False)
    got = step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    with torch.no_grad():  # the tiny model's other norms require grad, as a model built in-process does
        expected = engine.forward._model_step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    scale = expected.abs().max().item()
    assert step.fused is None or step.fused.steps == in_c_before + 1  # in C again, over the new weight
    assert torch.allclose(got, expected, atol=1e-4 * scale) and not torch.allclose(got, unchanged, atol=1e-2 * scale)


def test_serving_requests_registers_no_parameter_so_no_step_reads_its_layers_again(make_tiny, tokenizer):
    """Any Parameter registered in the process makes the steps read their layers again (see the test above):
    answering, alone and in a batch, must register none, or every step would rebuild."""
    engine = int4_engine(make_tiny, tokenizer)
    ids = engine.add_documents(DOCUMENTS, progress=False)
    engine.generate(build_prompt("Who won?", ids), max_new_tokens=2)
    before, steps = blocks.weights_generation(), engine.forward.written_step.fused.steps
    engine.generate(build_prompt("Who won?", ids), max_new_tokens=6)
    engine.generate_batch([build_prompt(q, ids) for q in ("Who won?", "Who sang?")], max_new_tokens=6)
    assert blocks.weights_generation() == before and engine.forward.written_step.fused.steps > steps


def test_a_joined_layers_bias_changed_in_place_is_read_by_the_joined_product(make_tiny, tokenizer):
    """q, k and v multiply as one product whose bias is theirs end to end: each layer's bias is a view
    of it, so a change in place (as load_state_dict copies) reaches the product and the C step alike."""
    engine = int4_engine(make_tiny, tokenizer, "qwen2")
    step, model = engine.forward.written_step, engine.model
    layer = model.model.layers[1].self_attn.k_proj
    assert layer.siblings is not None
    ids, positions = torch.tensor([[7]]), torch.tensor([[9]])
    unchanged = engine.forward._model_step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    with torch.no_grad():
        layer.bias.mul_(3.0).add_(0.5)
    got = step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    expected = engine.forward._model_step(ids, positions, None, random_cache(model, 9, fixed=True).cache)
    scale = expected.abs().max().item()
    assert torch.allclose(got, expected, atol=1e-4 * scale) and not torch.allclose(expected, unchanged, atol=1e-2 * scale)


@pytest.mark.parametrize("heads", ["of 16", "of 64"])
@pytest.mark.parametrize("by_extents", [False, True])
def test_attention_split_in_spans_merges_as_one_softmax(make_tiny, tokenizer, by_extents, heads, kernel_form):
    """The C step splits each row's entries in spans of 256 (so that two threads share one row's key
    heads) and merges them in order: over 700 entries, with a span that attends nothing, a row that
    starts mid-span and (by extents) a finished row, the model's own logits; with heads of 64 in 16
    lanes too (AVX-512)."""
    engine = int4_engine(make_tiny, tokenizer, "qwen2", **(HEADS_OF_64 if heads == "of 64" else {}))
    step, model = engine.forward.written_step, engine.model
    entries = 700
    ids, positions = torch.tensor([[7], [11], [5]]), torch.tensor([[entries], [entries - 300], [4]])
    attend = torch.ones(3, 1, 1, entries + 1, dtype=torch.bool)
    attend[0, ..., 256:520] = False  # row 0: nothing in its second span
    attend[1, ..., :300] = False  # row 1 from the middle of its second span
    attend[2, ..., 5:] = False
    case = {}
    if by_extents:
        attend[2] = False
        case = {"extents": row_extents.RowExtents((0, 300, None), entries + 1)}
    before = step.fused.steps
    got = step(ids, positions, attend, random_cache(model, entries, fixed=True, rows=3, room=1, seed=5).cache, **case)
    expected = engine.forward._model_step(ids, positions, attend, random_cache(model, entries, fixed=True, rows=3, room=1, seed=5).cache,
                                          **{row_extents.KWARG: value for value in case.values()})
    assert step.fused.steps == before + 1
    live = slice(0, 2 if by_extents else 3)
    assert torch.allclose(got[live], expected[live], atol=1e-4 * expected[live].abs().max().item())


def logits_on_threads(step, model, counts: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """One step of two rows over 300 cached entries (two spans; the second row attends 7) on each thread count."""
    ids, positions = torch.tensor([[7], [11]]), torch.tensor([[300], [6]])
    attend = torch.ones(2, 1, 1, 301, dtype=torch.bool)
    attend[1, ..., 7:] = False
    previous, logits = torch.get_num_threads(), {}
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            logits[threads] = step(ids, positions, attend, random_cache(model, 300, fixed=True, rows=2, room=1, seed=5).cache)
    finally:
        torch.set_num_threads(previous)
    return logits


@pytest.mark.parametrize("weights,inputs", [("int4", 32), ("int4", 16), ("int4-a8", 8)])
def test_the_c_steps_logits_do_not_depend_on_its_thread_count(make_tiny, tokenizer, weights, inputs):
    """Its threads share out chunks of output features and (row, key head, span) triples, each summed
    by one thread in one order whichever thread takes it: the engine's measurement of one thread
    against two changes no token."""
    if inputs == 16:
        sixteen_bit_inputs_here()
    engine = int4_engine(make_tiny, tokenizer, "qwen2", weights=weights, inputs=inputs)
    assert engine.forward.written_step.fused.activation_bits == inputs
    step = engine.forward.written_step
    before = step.fused.steps
    logits = logits_on_threads(step, engine.model, (1, 2, 3))
    assert step.fused.steps == before + 3
    assert torch.equal(logits[1], logits[2]) and torch.equal(logits[1], logits[3])


def test_int4_a8_decodes_on_8_bit_inputs_near_float_inputs(make_tiny, tokenizer):
    """weights="int4-a8": proved on float32 inputs, then the C step multiplies inputs rounded to 8 bits a
    block: logits near the float inputs' (not equal: the rounding is there)."""
    engine = int4_engine(make_tiny, tokenizer, "qwen2", weights="int4-a8")
    step, fused = engine.forward.written_step, engine.forward.written_step.fused
    assert fused.activation_bits == 8
    eight = logits_on_threads(step, engine.model, (2,))[2]
    fused.activation_bits = 32
    try:
        floats = logits_on_threads(step, engine.model, (2,))[2]
    finally:
        fused.activation_bits = 8
    difference = ((eight - floats).abs().max() / floats.abs().max()).item()
    assert 0 < difference < 5e-2, difference


def test_each_engine_keeps_the_inputs_it_was_built_with_over_one_model_object(make_tiny, tokenizer):
    """weights= changes the model object's layers (as documented); an engine built later over the same
    model with weights="int4" multiplies 16-bit inputs (float32 ones on a CPU without AVX512-VNNI), and the
    int4-a8 engine before it keeps 8-bit ones."""
    model = drawn_away(make_tiny("llama"))
    eight = PromptCache(model, tokenizer, weights="int4-a8")
    sixteen = PromptCache(model, tokenizer, weights="int4")
    assert eight.forward.written_step.fused.activation_bits == 8
    assert sixteen.forward.written_step.fused.activation_bits == (16 if loader.library().a16_kernels(-1) else 32)


def test_int4_decodes_on_16_bit_inputs_near_float_inputs(make_tiny, tokenizer):
    """weights="int4" on AVX512-VNNI: proved on float32 inputs, then the C step multiplies inputs rounded
    to 16 bits a block (a16_kernels.c): logits near the float inputs', and far nearer than 8 bits'."""
    sixteen_bit_inputs_here()
    engine = int4_engine(make_tiny, tokenizer, "qwen2", inputs=16)
    step, fused = engine.forward.written_step, engine.forward.written_step.fused
    by_bits = {}
    for bits in (16, 32, 8):
        fused.activation_bits = bits
        by_bits[bits] = logits_on_threads(step, engine.model, (2,))[2]
    fused.activation_bits = 16

    def difference(bits: int) -> float:
        return ((by_bits[bits] - by_bits[32]).abs().max() / by_bits[32].abs().max()).item()

    assert 0 < difference(16) < 1e-3 and difference(16) < difference(8) / 20, (difference(16), difference(8))


def row_invariant_kernels(inputs: int) -> contextlib.AbstractContextManager:
    """The kernels whose products sum a row in one order at every row count: 16-bit inputs (skipped
    without AVX512-VNNI), or the float-input kernels' AVX2 form (on any CPU)."""
    if inputs == 16:
        sixteen_bit_inputs_here()
        return contextlib.nullcontext()
    return avx2_float_kernels()


ROW_INVARIANT_INPUTS = pytest.mark.parametrize("inputs", [16, 32], ids=["16-bit inputs", "AVX2 float inputs"])


@ROW_INVARIANT_INPUTS
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_row_decodes_the_same_alone_and_beside_others(make_tiny, tokenizer, arch, inputs):
    """A batch's rows get, bit for bit, the logits each gets alone: every product sums a row in one order
    at every row count, so a caller's tokens do not depend on who shares its steps (on float inputs the
    AVX2 several-row kernel once summed in another order than the one-row kernel, and a row's logits moved)."""
    with row_invariant_kernels(inputs):
        engine = int4_engine(make_tiny, tokenizer, arch, inputs=inputs)
        step, model = engine.forward.written_step, engine.model
        ids, positions = torch.tensor([[7], [11], [3]]), torch.tensor([[40], [23], [31]])
        together = random_cache(model, 40, fixed=True, rows=3, room=1, seed=6)
        ran = step.fused.steps
        logits = step(ids, positions, None, together.cache)
        for row in range(3):
            alone = random_cache(model, 40, fixed=True, rows=1, room=1)
            alone.storage.copy_(together.storage[:, :, row:row + 1])
            assert torch.equal(step(ids[row:row + 1], positions[row:row + 1], None, alone.cache), logits[row:row + 1]), row
        assert step.fused.steps == ran + 4  # every step ran in C


def shared_kv(model, step, parts: list[tuple[int, int, object, int, float, float]], seed: int = 8) -> shared_attention.SharedKV:
    """Random module KV read in place: per part (entries, first position, rows, shift, temperature, log_scale)."""
    generator = torch.Generator().manual_seed(seed)
    layers, kv_heads = len(step.layers), step.kv_heads
    dim = step.layers[0].q.out_features // step.heads
    built = [shared_attention.SharedPart(torch.randn(layers, 2, kv_heads, n, dim, generator=generator), torch.arange(first, first + n),
                                         rows, shift, temperature, log_scale) for n, first, rows, shift, temperature, log_scale in parts]
    return shared_attention.SharedKV(built, heads_per_kv=step.heads // kv_heads, dtype=torch.float32, rotator=RopeRotator(model))


# three rows: all read a 600-entry part (three spans), rows 0 and 2 a moved one under APE, row 1 a moved one of 9
PARTS = [(600, 0, slice(0, 3), 0, 1.0, 0.0), (300, 600, (0, 2), 7, 1.3, 0.25), (9, 900, (1,), -4, 1.0, -0.5)]


@pytest.mark.parametrize("heads", ["of 16", "of 64"])
@pytest.mark.parametrize("by_extents", [False, True])
def test_shared_kv_read_in_place_decodes_in_c_as_the_tensor_ops_do(make_tiny, tokenizer, heads, by_extents, kernel_form):
    """RelayAttention in the C step: parts read by some rows or all, spread over spans, moved (queries rotated
    back) and adjusted (APE), merged with each row's own entries: the tensor ops' logits."""
    engine = int4_engine(make_tiny, tokenizer, "qwen2", **(HEADS_OF_64 if heads == "of 64" else {}))
    step, model = engine.forward.written_step, engine.model
    kv = shared_kv(model, step, PARTS)
    ids, positions = torch.tensor([[7], [11], [5]]), torch.tensor([[930], [925], [912]])
    attend = torch.ones(3, 1, 1, 21, dtype=torch.bool)
    attend[1, ..., :4] = False
    case = {"extents": row_extents.RowExtents((0, 3, 0), 21)} if by_extents else {}
    before = (step.fused.steps, step.fused.shared_steps)
    got = step(ids, positions, attend, random_cache(model, 20, fixed=True, rows=3, room=1, seed=5).cache,
               shared=kv.for_queries(positions, (912, 930)), **case)
    assert (step.fused.steps, step.fused.shared_steps) == (before[0] + 1, before[1] + 1)
    fused, step.fused = step.fused, None
    try:
        expected = step(ids, positions, attend, random_cache(model, 20, fixed=True, rows=3, room=1, seed=5).cache,
                        shared=kv.for_queries(positions, (912, 930)), **case)
    finally:
        step.fused = fused
    alone = step(ids, positions, attend, random_cache(model, 20, fixed=True, rows=3, room=1, seed=5).cache, **case)
    scale = expected.abs().max().item()
    assert torch.allclose(got, expected, atol=1e-4 * scale)
    assert not torch.allclose(alone, expected, atol=1e-2 * scale)  # the shared parts count


@ROW_INVARIANT_INPUTS
def test_a_row_reading_shared_kv_decodes_the_same_alone_and_beside_others(make_tiny, tokenizer, inputs):
    """A row's arithmetic does not depend on the rows beside it, shared parts included: a caller's
    tokens are the same whoever shares its step."""
    with row_invariant_kernels(inputs):
        a_row_reading_shared_kv_alone_and_beside_others(make_tiny, tokenizer, inputs)


def a_row_reading_shared_kv_alone_and_beside_others(make_tiny, tokenizer, inputs: int) -> None:
    engine = int4_engine(make_tiny, tokenizer, "llama", inputs=inputs, **HEADS_OF_64)
    step, model = engine.forward.written_step, engine.model
    ids, positions = torch.tensor([[7], [11], [5]]), torch.tensor([[930], [925], [912]])
    together = random_cache(model, 20, fixed=True, rows=3, room=1, seed=6)
    logits = step(ids, positions, None, together.cache, shared=shared_kv(model, step, PARTS).for_queries(positions, (912, 930)))
    for row in range(3):
        alone = random_cache(model, 20, fixed=True, rows=1, room=1)
        alone.storage.copy_(together.storage[:, :, row:row + 1])
        own = [(n, first, (0,), shift, t, s) for n, first, rows, shift, t, s in PARTS if row in shared_attention.row_list(rows)]
        kv = shared_kv(model, step, PARTS).select([row], 0)  # the same tensors, read by the row alone
        kv = shared_attention.SharedKV(kv, heads_per_kv=step.heads // step.kv_heads, dtype=torch.float32, rotator=RopeRotator(model))
        assert len(kv.parts) == len(own)
        got = step(ids[row:row + 1], positions[row:row + 1], None, alone.cache,
                   shared=kv.for_queries(positions[row:row + 1], (int(positions[row]), int(positions[row]))))
        assert torch.equal(got, logits[row:row + 1]), row


def test_shared_kv_a_query_must_not_wholly_see_goes_to_the_tensor_ops_logged_once(make_tiny, tokenizer, caplog):
    """A part placed after a row's query needs a mask over shared keys, which the C step does not take: the
    tensor ops run that step (one log line says why, once) and answer as the model does."""
    engine = int4_engine(make_tiny, tokenizer)
    step, model = engine.forward.written_step, engine.model
    kv = shared_kv(model, step, [(40, 0, slice(0, 2), 0, 1.0, 0.0)])
    ids, positions = torch.tensor([[7], [11]]), torch.tensor([[60], [30]])  # row 1 sits before the part's last keys
    before = step.fused.steps
    with caplog.at_level("INFO", logger="pc_rag.forward.fused_step"):
        for _ in range(2):
            got = step(ids, positions, None, random_cache(model, 8, fixed=True, rows=2, room=1).cache, shared=kv.for_queries(positions, (30, 60)))
    assert step.fused.steps == before
    assert sum("mask over shared parts" in r.getMessage() for r in caplog.records) == 1
    expected = engine.forward._model_step(ids, positions, None, random_cache(model, 8, fixed=True, rows=2, room=1).cache,
                                          **{shared_attention.KWARG: kv.for_queries(positions, (30, 60))})
    assert torch.allclose(got, expected, atol=1e-4 * expected.abs().max().item())


# -- the boundary: what the C reads is checked before it reads it ------------------------------------

@pytest.mark.parametrize("fixed", [True, False])
def test_a_full_kv_buffer_raises_a_typed_error_and_nothing_is_written(make_tiny, tokenizer, fixed):
    """A step at a buffer's capacity: the C step wrote past the buffer (AddressSanitizer: a heap-buffer-overflow
    WRITE in llama_step.c) where the tensor ops raised IndexError; now both paths refuse it in Python."""
    engine = int4_engine(make_tiny, tokenizer)
    step = engine.forward.written_step
    full = random_cache(engine.model, 9, fixed=fixed, room=0)
    if fixed:
        full.fix(9, torch.tensor([9]))  # the cursor at the capacity
    before = full.storage.clone()
    ran = step.fused.steps
    with pytest.raises(PromptCacheError, match="overflow"):
        step(torch.tensor([[7]]), torch.tensor([[9]]), None, full.cache)
    assert step.fused.steps == ran and torch.equal(full.storage, before)


def test_the_c_step_itself_refuses_a_cursor_outside_the_kv_storage():
    """The C checks the bounds it can check cheaply, whatever the caller checked."""
    from pc_rag.kernels.step import Step
    lib = loader.library()
    for column, entries in ((4, 4), (-1, 4), (0, 5), (0, 0)):
        args = Step(None, 0, 1, 8, 1, 1, 8, 8, capacity=4, column=column, entries=entries, work_floats=1 << 40)
        assert lib.llama_step(ctypes.byref(args)) == -2, (column, entries)


def test_a_kv_buffer_of_another_layout_is_refused_before_the_c_step_reads_it(make_tiny, tokenizer):
    engine = int4_engine(make_tiny, tokenizer)
    step = engine.forward.written_step
    model = engine.model
    narrow = random_cache(model, 9, fixed=True)
    layer = narrow.cache.layers[1]
    layer.rebase(layer._keys_all[..., :-1], layer._values_all[..., :-1])  # one layer's heads a float short
    with pytest.raises(PromptCacheError, match="layout|entries"):
        step(torch.tensor([[7]]), torch.tensor([[9]]), None, narrow.cache)


def test_the_c_step_itself_refuses_shared_parts_it_cannot_read():
    """A part read by a row the step does not have, by a row twice, or with no entries: refused by the C
    before any work is sized, whatever the caller checked."""
    from pc_rag.kernels.step import Shared, Step
    lib = loader.library()
    keys = torch.zeros(4, 8)
    for rows, entries in (([0, 2], 4), ([1, 1], 4), ([0], 0), ([-1], 4)):
        reading = torch.tensor(rows, dtype=torch.int64)
        part = Shared(keys.data_ptr(), keys.data_ptr(), entries, 32, 32, 8, reading.data_ptr(), len(rows), None, None, 1.0, 0.0)
        args = Step(n_layers=1, rows=2, hidden=8, heads=1, kv_heads=1, head_dim=8, intermediate=8, entries=1, capacity=1,
                    shared=ctypes.addressof(part), n_shared=1)
        assert lib.llama_step_work(ctypes.byref(args)) == -1, (rows, entries)
    args.n_shared = 0
    assert lib.llama_step_work(ctypes.byref(args)) > 0


def test_the_step_structures_are_checked_against_the_librarys_layout():
    from pc_rag.kernels import step as step_structures

    class StepWithoutCapacity(ctypes.Structure):  # the layout before the capacity field: refused at load
        _fields_ = [(name, kind) for name, kind in step_structures.Step._fields_ if name != "capacity"]

    lib = loader.library()
    assert step_structures.layout_agrees(lib) is None
    problem = step_structures.layout_agrees(lib, (step_structures.Product, step_structures.Layer, StepWithoutCapacity,
                                                   step_structures.Shared))
    assert problem is not None and "laid out" in problem


def test_the_products_check_every_tensor_they_hand_to_c():
    from pc_rag.kernels import products
    lib = loader.library()
    generator = torch.Generator().manual_seed(0)
    words = products.pack_nibbles(torch.randint(0, 16, (6, 64), generator=generator))
    scales, minimums, x = torch.rand(6, 2), torch.randn(6, 2), torch.randn(3, 64)
    assert products.q4_matmul(x, words, scales, minimums, None, lib=lib).shape == (3, 6)
    bad = {"x": (x.double(), words, scales, minimums, None), "x ": (torch.randn(3, 32), words, scales, minimums, None),
           "x  ": (torch.randn(64, 3).t(), words, scales, minimums, None), "values": (x, words[:, :4], scales, minimums, None),
           "minimums": (x, words, scales, minimums[:5], None), "bias": (x, words, scales, minimums, torch.zeros(5)),
           "scales": (x, words, scales.half(), minimums, None)}
    for name, arguments in bad.items():
        with pytest.raises(PromptCacheError) as refused:
            products.q4_matmul(*arguments, lib=lib)
        assert refused.value.param == name.strip(), (name, refused.value)
    with pytest.raises(PromptCacheError, match="values"):
        products.q8_matmul(x, torch.zeros(6, 64, dtype=torch.uint8), scales, None, lib=lib)
    with pytest.raises(PromptCacheError, match="holds"):
        products.dequantize_into(torch.empty(100), 0, 6, words, scales, minimums, lib=lib)
    with pytest.raises(PromptCacheError, match="within"):
        products.dequantize_into(torch.empty(6 * 64), 2, 7, words, scales, minimums, lib=lib)
