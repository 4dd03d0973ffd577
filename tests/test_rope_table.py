"""The C decode step's cos/sin table (``pc_rag.forward.rope_table``): the model's rotary module's own
values, rebuilt when the module's frequencies change, and not used where they follow the input
or a hook asks for the module."""

from __future__ import annotations

import pytest
import torch

from pc_rag.forward.rope_table import RopeTable
from pc_rag.forward.rotation import signed_sin
from tests.test_fused_step import HEADS_OF_64, int4_engine

POSITIONS = [0, 1, 255, 256, 257, 700, 1023]


def module_rows(rotary, positions: list[int], *, span: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's cos and signed sin at ``positions`` from one call over positions [0, span), as a prefill asks."""
    cos, sin = rotary(torch.empty(1, 1, 1), torch.arange(span)[None])
    return cos[0, positions], signed_sin(sin[0])[positions]


@pytest.mark.parametrize("shape", ["heads of 16", "heads of 64"])
def test_the_table_holds_the_rotary_modules_own_values(make_tiny, shape):
    rotary = make_tiny("llama", **(HEADS_OF_64 if shape == "heads of 64" else {})).model.rotary_emb
    table = RopeTable.build(rotary, torch.empty(1, 1, 8))
    assert table is not None
    cos, sin = table.rows(torch.tensor(POSITIONS)[:, None])
    expected_cos, expected_sin = module_rows(rotary, POSITIONS)
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
    assert cos.is_contiguous() and sin.is_contiguous()
    if shape == "heads of 64":  # a one-position call runs the same vector code: the same bits as the step's own call
        for position in POSITIONS:
            one_cos, one_sin = rotary(torch.empty(1, 1, 1), torch.tensor([[position]]))
            single = table.rows(torch.tensor([[position]]))
            assert torch.equal(single[0], one_cos[:, 0]) and torch.equal(single[1], signed_sin(one_sin[:, 0]))


def test_positions_past_the_table_grow_it_and_new_frequencies_rebuild_it(make_tiny):
    rotary = make_tiny("llama").model.rotary_emb
    table = RopeTable.build(rotary, torch.empty(1, 1, 8))
    table.rows(torch.tensor([[3]]))
    assert table.table[1].shape[0] == 256
    far = [5, 3000, 4100]
    cos, sin = table.rows(torch.tensor(far)[:, None])
    assert table.table[1].shape[0] >= 4101
    assert torch.equal(cos, module_rows(rotary, far, span=4352)[0]) and torch.equal(sin, module_rows(rotary, far, span=4352)[1])
    rotary.inv_freq.mul_(0.5)  # frequencies changed in place (a user's rescaling): the table follows
    cos, sin = table.rows(torch.tensor(POSITIONS)[:, None])
    expected_cos, expected_sin = module_rows(rotary, POSITIONS)
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)


def test_no_table_where_frequencies_follow_the_input_or_a_hook_asks_for_the_module(make_tiny):
    dynamic = make_tiny("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}).model.rotary_emb
    assert RopeTable.build(dynamic, torch.empty(1, 1, 8)) is None
    rotary = make_tiny("llama").model.rotary_emb
    table = RopeTable.build(rotary, torch.empty(1, 1, 8))
    handle = rotary.register_forward_hook(lambda module, args, out: out)
    try:
        assert table.rows(torch.tensor([[4]])) is None
    finally:
        handle.remove()
    assert table.rows(torch.tensor([[4]])) is not None


def test_the_c_step_reads_the_table_and_answers_as_the_module_would(make_tiny, tokenizer):
    engine = int4_engine(make_tiny, tokenizer, **HEADS_OF_64)
    step = engine.forward.written_step
    assert step.fused is not None and list(step.fused.ropes) == [None]
    first = engine.generate("Tell me about the sea.", max_new_tokens=6)
    assert step.fused.ropes[None].table[1].shape[0] > 0, "the step filled its table"
    step.fused.ropes = None  # the module called at every step, as before the table
    again = engine.generate("Tell me about the sea.", max_new_tokens=6)
    assert first.token_ids == again.token_ids


def test_frequencies_by_layer_type_get_a_table_each_and_the_c_step_reads_its_layers_own(make_tiny, tokenizer):
    """Gemma 3's local and global layers (bases 10,000 and 1,000,000, heads of 64 so a one-position call is
    the table's bits): each type's table holds the module's values for that type, and the step answers as
    with the module called at every step."""
    engine = int4_engine(make_tiny, tokenizer, "gemma3", head_dim=64, rope_theta=1e6)
    step = engine.forward.written_step
    rotary = engine.model.model.rotary_emb
    assert step.fused is not None and sorted(step.fused.ropes) == ["full_attention", "sliding_attention"]
    for kind, table in step.fused.ropes.items():
        cos, sin = table.rows(torch.tensor(POSITIONS)[:, None])
        expected_cos, expected_sin = (part[0, POSITIONS] for part in rotary(torch.empty(1, 1, 1), torch.arange(1024)[None], kind))
        assert torch.equal(cos, expected_cos) and torch.equal(sin, signed_sin(expected_sin))
        for position in (0, 300):
            one_cos, one_sin = rotary(torch.empty(1, 1, 1), torch.tensor([[position]]), kind)
            single = table.rows(torch.tensor([[position]]))
            assert torch.equal(single[0], one_cos[:, 0]) and torch.equal(single[1], signed_sin(one_sin[:, 0]))
    local, full = (step.fused.ropes[kind].rows(torch.tensor([[700]]))[0] for kind in ("sliding_attention", "full_attention"))
    assert not torch.equal(local, full), "the two types turn by their own frequencies"
    first = engine.generate("Tell me about the sea.", max_new_tokens=6)
    assert step.fused.steps > 0 and all(table.table[1].shape[0] > 0 for table in step.fused.ropes.values())
    step.fused.ropes = None
    again = engine.generate("Tell me about the sea.", max_new_tokens=6)
    assert first.token_ids == again.token_ids


def test_a_model_made_in_inference_mode_gets_a_table_that_follows_its_frequencies(make_tiny, tokenizer):
    with torch.inference_mode():  # inv_freq an inference tensor: torch counts no versions of it
        engine = int4_engine(make_tiny, tokenizer, **HEADS_OF_64)
        step = engine.forward.written_step
        assert step.fused is not None and step.fused.ropes is not None
        first = engine.generate("Tell me about the sea.", max_new_tokens=4)
        assert step.fused.steps > 0
        rotary = engine.model.model.rotary_emb
        rotary.inv_freq.mul_(0.5)  # in place, in inference mode
        cos, sin = step.fused.ropes[None].rows(torch.tensor(POSITIONS)[:, None])
        expected_cos, expected_sin = module_rows(rotary, POSITIONS)
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
    assert first.token_ids
