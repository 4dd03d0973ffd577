"""The decode step: fixed shapes, state kept on the device, one batch-wide choice per step."""

from __future__ import annotations

import pytest
import torch

from pc_rag import PromptCache
from pc_rag.decode.sampling import TokenHistory
from pc_rag.errors import PromptCacheError

PROMPT = "the cat sat on the mat and then the cat sat on the"


def _record_steps(model: torch.nn.Module) -> tuple[list[tuple[tuple[int, ...], int]], object]:
    """(input shape, key length the mask covers) of every forward pass the model runs."""
    calls: list[tuple[tuple[int, ...], int]] = []

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            mask = next(iter(mask.values()))
        calls.append((tuple(kwargs["input_ids"].shape), -1 if mask is None else mask.shape[-1]))

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8})])
def test_every_decode_step_has_the_same_shapes_and_the_answer_is_unchanged(make_tiny, tokenizer, arch, overrides):
    """One row and a batch: after prefill, every step feeds [rows, 1] tokens against the same
    number of keys (the row's fixed decode capacity), and the tokens are transformers' own."""
    model = make_tiny(arch, seed=3, **overrides)
    engine = PromptCache(model, tokenizer, recompute=0)
    engine.stop_token_ids = set()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()

    calls, handle = _record_steps(model)
    try:
        single = engine.generate(PROMPT, max_new_tokens=12)
        steps = calls[1:]
        assert len(steps) == 11 and {shape for shape, _ in steps} == {(1, 1)}
        assert len({keys for _, keys in steps}) == 1 and steps[0][1] >= ids.shape[1] + 11
        calls.clear()
        batch = engine.generate_batch([PROMPT, "a different and longer prompt about dogs and their owners"], max_new_tokens=12)
        steps = calls[1:]
        assert {shape for shape, _ in steps} == {(2, 1)} and len({keys for _, keys in steps}) == 1
    finally:
        handle.remove()
    assert single.token_ids == reference
    assert batch[0].token_ids == reference


def test_a_finished_row_stops_while_the_others_go_on(make_tiny, tokenizer):
    """Rows of a batch end at different steps (their own budgets via stops): each answer is its single call's."""
    model = make_tiny("llama", seed=5)
    engine = PromptCache(model, tokenizer, recompute=0)
    prompts = [PROMPT, "another prompt, quite different from the first one"]
    singles = [engine.generate(p, max_new_tokens=10) for p in prompts]
    # the first row's third token ends it; the second row goes on to its budget
    engine.stop_token_ids = set(engine.stop_token_ids) | {singles[0].token_ids[2]}
    assert singles[0].token_ids[2] not in singles[1].token_ids
    batch = engine.generate_batch(prompts, max_new_tokens=10)
    assert batch[0].token_ids == singles[0].token_ids[:2] and batch[0].finish_reason == "stop"
    assert batch[1].token_ids == singles[1].token_ids


def test_token_history_is_one_tensor_appended_in_place():
    history = TokenHistory([[1, 2, 3], [4]], steps=3, device=torch.device("cpu"))
    storage = history.ids.data_ptr()
    history.append(torch.tensor([[7], [8]]))
    history.append(torch.tensor([[9], [10]]))
    assert history.view(0).tolist() == [[1, 2, 3, 7, 9]]
    assert history.view(1).tolist() == [[4, 8, 10]]
    assert history.ids.data_ptr() == storage  # no copy of the whole history per step


def test_one_grammar_mask_for_a_batch_is_each_rows_own(tokenizer):
    """Rows under a grammar get exactly what their matcher allows; a row without one, everything."""
    import llguidance.torch

    from pc_rag.decode.constrained import Vocabulary, allowed_tokens, schema_text

    vocab = len(tokenizer)
    vocabulary = Vocabulary(tokenizer, vocab, frozenset({tokenizer.eos_token_id}))
    numbers = vocabulary.matcher(schema_text({"type": "integer"}))
    names = vocabulary.matcher(schema_text({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}))
    errors: list = []
    allowed = allowed_tokens([numbers, None, names], vocab, torch.device("cpu"), lambda row, err: errors.append((row, err)))
    assert errors == []
    assert allowed.shape == (3, vocab) and allowed.dtype == torch.bool
    for row, matcher in ((0, numbers), (2, names)):
        own = llguidance.torch.allocate_token_bitmask(1, vocab)
        matcher.fill(own, 0)
        assert torch.equal(allowed[row], vocabulary.allowed(own[0])[:vocab])
    assert bool(allowed[1].all())
    assert 0 < int(allowed[0].sum()) < vocab and not torch.equal(allowed[0], allowed[2])


@pytest.mark.parametrize("mode", [True, "reduce-overhead"])
def test_compiled_decode_step_gives_the_same_tokens(make_tiny, tokenizer, mode):
    """compile=True (or a mode by name) runs the fixed-shape step through torch.compile: same
    greedy tokens, single and batch. "reduce-overhead" also marks the KV buffer static and copies
    the logits out of the graph's memory (CUDA graphs themselves need a GPU: benchmarks/gpu.py)."""
    model = make_tiny("llama", seed=11)
    eager = PromptCache(model, tokenizer, recompute=0)
    compiled = PromptCache(model, tokenizer, recompute=0, compile=mode)
    assert compiled.forward.compile_mode == ("default" if mode is True else mode) and eager.forward.compile_mode is None
    for engine in (eager, compiled):
        engine.stop_token_ids = set()
    prompts = [PROMPT, "another prompt, a different one"]
    assert compiled.generate(PROMPT, max_new_tokens=8).token_ids == eager.generate(PROMPT, max_new_tokens=8).token_ids
    ours = [g.token_ids for g in compiled.generate_batch(prompts, max_new_tokens=8)]
    assert ours == [g.token_ids for g in eager.generate_batch(prompts, max_new_tokens=8)]
    assert compiled.forward.compiled_steps == 7 + 7 and eager.forward.compiled_steps == 0


def test_a_compiled_step_serving_many_batch_shapes_keeps_compiling(make_tiny, tokenizer):
    """Serving changes a batch's rows and cache capacity from one step to the next. A step
    compiled once per exact shape hit dynamo's recompile limit (8) after eight shapes and from
    then on ran eagerly with a warning; the step compiles a few times and runs every shape
    compiled, with the same tokens as eager. Through the CPU's decode-sized linear layers too
    (pc_rag.weights.small_batch), whose row check once failed on a symbolic batch size."""
    model = make_tiny("llama", seed=11)
    eager = PromptCache(model, tokenizer, recompute=0, small_batch_linear=True)
    compiled = PromptCache(model, tokenizer, recompute=0, compile=True, small_batch_linear=True)
    for engine in (eager, compiled):
        engine.stop_token_ids = set()
    words = PROMPT.split()
    torch._dynamo.reset()  # compilations of earlier tests count towards the limit
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for rows in range(1, 11):  # 10 batch sizes, prompts of 6 to ~170 tokens: capacities 256 to 1024
            prompts = [" ".join(words * (1 + (rows * 7 + row) % 13))[: 40 + 60 * row] for row in range(rows)]
            ours = [g.token_ids for g in compiled.generate_batch(prompts, max_new_tokens=4)]
            assert ours == [g.token_ids for g in eager.generate_batch(prompts, max_new_tokens=4)], rows
    assert compiled.forward.compiled_steps == 3 * 10


def test_a_compiled_step_over_a_buffer_with_reserved_rows_gives_the_eager_logits(make_tiny):
    """Two buffers whose layer views have the same shape, one over more allocated rows (the
    scheduler reserves rows for newcomers): the compiled step compiled for the first failed the
    second with an inductor size assertion on the tensor the views share. Such a buffer runs
    eagerly, with the same logits, and the compiled step still serves the other."""
    from pc_rag.forward.forward import Forward
    from pc_rag.kv.buffers import KVBuffer

    model = make_tiny("llama", seed=11)
    compiled, eager = Forward(model, compile=True), Forward(model)
    layers, kv_heads, dim = model.config.num_hidden_layers, model.config.num_key_value_heads, 16
    torch.manual_seed(0)
    kv = torch.randn(layers, 2, 2, kv_heads, 10, dim)

    def step(forward: Forward, reserve: int) -> torch.Tensor:
        buffer = KVBuffer(layers, kv_heads, dim, 256, dtype=torch.float32, device=torch.device("cpu"), batch=2, reserve=reserve)
        buffer.storage.zero_()
        buffer.storage[..., :10, :] = kv
        buffer.grow_to(10)
        buffer.fix(256, torch.tensor([10]))
        mask = torch.zeros(2, 1, 1, 256, dtype=torch.bool)
        mask[..., :11] = True
        ids, positions = torch.tensor([[5], [7]]), torch.full((2, 1), 10)
        return forward.decode_batch(buffer, ids, positions, (10, 10), mask)

    for reserve in (0, 3, 0):
        torch.testing.assert_close(step(compiled, reserve), step(eager, reserve))
    assert compiled.compiled_steps == 2


@pytest.mark.parametrize("mode", ["fast", "", 1, None])
def test_an_unknown_compile_mode_is_refused_before_anything_runs(make_tiny, tokenizer, mode):
    with pytest.raises(PromptCacheError, match="compile must be True, False or one of 'default', 'reduce-overhead'"):
        PromptCache(make_tiny("llama", seed=11), tokenizer, compile=mode)


def test_a_buffer_marked_static_marks_every_layer_view_and_again_after_the_views_change():
    """What a CUDA-graph step reads and writes in place is marked a static input, once per set
    of views (a decode step does not loop over the layers again), and again once ``fix`` or
    ``widen`` makes new views."""
    from pc_rag.kv.buffers import KVBuffer

    def marked(buffer: KVBuffer) -> list[bool]:
        return [getattr(t, "_dynamo_static_input_type", None) is not None
                for layer in buffer.cache.layers for t in (layer._keys_all, layer._values_all, layer.keys, layer.values)]

    buffer = KVBuffer(3, 2, 4, 16, dtype=torch.float32, device=torch.device("cpu"), batch=1, reserve=1)
    buffer.grow_to(5)
    buffer.fix(9, torch.tensor([5]))
    assert not any(marked(buffer))
    buffer.mark_static()
    assert all(marked(buffer)) and len(marked(buffer)) == 12
    buffer.fix(12, torch.tensor([5]))  # new views of the same storage
    assert not any(marked(buffer)[2::4])
    buffer.mark_static()
    assert all(marked(buffer))
    buffer.widen(2)
    assert not any(marked(buffer))
    buffer.mark_static()
    assert all(marked(buffer))
