"""A prefill pass attends only to the tiles of keys its mask lets each block of queries see
(:mod:`pc_rag.forward.key_tiles`): the same attention as one SDPA call over every key, on masks as
a cached prompt builds them, and through the engine on real prompts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pc_rag import PromptCache, build_prompt
from pc_rag.forward import attention, key_tiles


def cached_prompt_mask(cached: int, computed: torch.Tensor, *, window: int | None = None) -> torch.Tensor:
    """What :func:`pc_rag.forward.attention.attention_mask` gives a cached prompt: ``cached`` entries
    at positions 0.. (every 7th a recomputed token, invalid), then the computed tokens at
    ``computed`` positions (ascending), each seeing the keys at or before it."""
    key_positions = torch.cat([torch.arange(cached), computed])
    valid = torch.ones(len(key_positions), dtype=torch.bool)
    valid[:cached:7] = False
    allowed = (key_positions[None, :] <= computed[:, None]) & valid[None, :]
    if window is not None:
        allowed &= key_positions[None, :] > computed[:, None] - window
    return allowed[None, None]


def spread_queries(cached: int, count: int, tail: int) -> torch.Tensor:
    """Recomputed tokens spread over the prompt, then a question of ``tail`` tokens after it."""
    spread = torch.linspace(3, cached - 1, count - tail).long()
    return torch.cat([spread, torch.arange(cached, cached + tail)])


def reference(query, key, value, mask, scale):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("window", [None, 300])
def test_tiles_equal_one_call_over_every_key(additive, window):
    torch.manual_seed(0)
    cached, computed = 900, spread_queries(900, 70, 12)
    allowed = cached_prompt_mask(cached, computed, window=window)
    mask = allowed
    if additive:  # APE's scale on some keys, as the engine's additive masks carry it
        bias = torch.where(torch.rand(allowed.shape[-1]) < 0.5, -0.36, 0.0)
        mask = torch.where(allowed, bias, torch.finfo(torch.float32).min)
    query = torch.randn(1, 6, len(computed), 32)
    key, value = torch.randn(1, 2, allowed.shape[-1], 32), torch.randn(1, 2, allowed.shape[-1], 32)
    plan = key_tiles.plan_tiles(mask, torch.float32)
    assert plan is not None
    covered = torch.zeros(allowed.shape[-2:], dtype=torch.bool)
    for q0, q1, runs in plan.blocks:
        for k0, k1 in runs:
            covered[q0:q1, k0:k1] = True
    assert not (allowed[0, 0] & ~covered).any()  # every key a query sees is in its block's tiles
    assert covered.float().mean() <= key_tiles.WORTHWHILE  # and many it does not see are not
    got = key_tiles.attend(query, key, value, plan, 0.125)
    assert (got - reference(query, key, value, mask, 0.125)).abs().max().item() < 1e-5


def test_a_batch_is_planned_over_all_its_rows():
    """Rows of different lengths, left-padded: one plan covers what any row sees."""
    torch.manual_seed(1)
    long = cached_prompt_mask(1200, spread_queries(1200, 100, 8))
    short = cached_prompt_mask(900, spread_queries(900, 100, 8))
    short = F.pad(short, (long.shape[-1] - short.shape[-1], 0))  # left padding: keys no query of the row sees
    mask = torch.cat([long, short])
    query = torch.randn(2, 4, 100, 16)
    key, value = torch.randn(2, 1, mask.shape[-1], 16), torch.randn(2, 1, mask.shape[-1], 16)
    plan = key_tiles.plan_tiles(mask, torch.float32)
    assert plan is not None
    got = key_tiles.attend(query, key, value, plan, None)
    assert (got - reference(query, key, value, mask, None)).abs().max().item() < 1e-5


def test_one_call_where_tiles_would_not_pay_or_a_query_sees_no_key():
    dense = torch.ones(1, 1, 64, 1024, dtype=torch.bool)
    assert key_tiles.plan_tiles(dense, torch.float32) is None
    blind = cached_prompt_mask(900, spread_queries(900, 70, 12))
    blind[..., 5, :] = False  # a padding query: one call's answer for it stays what it was
    assert key_tiles.plan_tiles(blind, torch.float32) is None
    short = torch.zeros(1, 1, 8, 100, dtype=torch.bool)
    assert not key_tiles.usable(torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 100, 16), short)  # under MIN_KEYS keys: one call
    wide = torch.zeros(1, 1, 8, 1000, dtype=torch.bool)
    assert key_tiles.usable(torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 1000, 16), wide)
    assert not key_tiles.usable(torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 990, 16), wide)  # a mask wider than the keys


def test_half_precision_queries_keep_hidden_keys_finite():
    """float32's lowest mask value is -inf in float16: a block's query that sees no key of one run
    would give NaN there; hidden keys are the dtype's own lowest value."""
    torch.manual_seed(2)
    computed = spread_queries(900, 70, 12)
    allowed = cached_prompt_mask(900, computed)
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    query = torch.randn(1, 4, len(computed), 32, dtype=torch.bfloat16)
    key = torch.randn(1, 2, allowed.shape[-1], 32, dtype=torch.bfloat16)
    value = torch.randn(1, 2, allowed.shape[-1], 32, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16):
        plan = key_tiles.plan_tiles(mask, dtype)
        assert plan is not None and torch.isfinite(plan.additive).all()
    plan = key_tiles.plan_tiles(mask, torch.bfloat16)
    got = key_tiles.attend(query, key, value, plan, None).float()
    expected = reference(query.float(), key.float(), value.float(), mask, None)
    assert torch.isfinite(got).all() and (got - expected).abs().max().item() < 0.05


DOCUMENTS = [" ".join(f"Fact {d}.{i}: the {w} of item {i} is {d * i % 17}." for i, w in enumerate(["colour", "size", "age"]))
             for d in range(16)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_cached_prompt_answers_as_with_one_call(make_tiny, tokenizer, arch, monkeypatch):
    """A cached prompt of sixteen moved documents (default recovery and APE: recomputed tokens spread
    over it, an additive mask; Gemma 3: local layers' windows) through the engine, its tiles against
    one call over every key."""
    engine = PromptCache(make_tiny(arch), tokenizer, weights="float32")
    prompt = build_prompt("Which fact is about age?", engine.add_documents(DOCUMENTS, progress=False))
    plan = engine.plan(prompt)
    assert len(plan.input_ids) >= key_tiles.MIN_KEYS and plan.computed_tokens > 16 * 2
    before = attention.TILE_PLANS.tiled
    tiled = engine.next_token_logits(prompt)
    assert attention.TILE_PLANS.tiled > before  # the pass took the tiles
    monkeypatch.setattr(key_tiles, "MIN_KEYS", 10**9)  # every pass one call again
    one_call = engine.next_token_logits(prompt)
    assert (tiled - one_call).abs().max().item() < 1e-4
    assert engine.generate(prompt, max_new_tokens=8).text == engine.generate(prompt, max_new_tokens=8).text
