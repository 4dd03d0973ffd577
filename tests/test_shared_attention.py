"""Shared-module attention: split attention is exact, zero-copy assembly equals copying, and a
batch holds what its prompts share once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import pc_rag.prefill.assemble as assemble_mod
from pc_rag import PromptCache, PromptCacheError, build_prompt
from pc_rag.forward.rotation import RopeRotator
from pc_rag.forward.shared_attention import SharedKV, SharedPart, SharedRun, row_list, share_prefixes, split_attention

DOCS = [
    "The lighthouse on the northern cape was automated in 1987 and still flashes every ten seconds.",
    "Ferries to the island leave twice a day in summer and once a day in winter, weather permitting.",
    "The island's only school teaches eleven children in two classrooms heated by a wood stove.",
    "A single road circles the island; it is eleven kilometres long and has no traffic lights at all.",
]


# cohere: queries rotated back on interleaved pairs; gemma3: by the layer's own frequencies (layer 1
# is global, its neighbours local)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "cohere", "gemma3"])
def test_split_attention_equals_attention_over_the_concatenated_kv(make_tiny, tokenizer, arch):
    """Own keys + four shared parts (two moved, read unrotated; one query sees none of a part's
    keys; one read by rows that are not adjacent, as rows admitted at different times read a
    part) against one SDPA call over the keys concatenated, rotated and masked by position."""
    if arch == "gemma3":
        model = make_tiny(arch)
        rotator = PromptCache(model, tokenizer).rotator
        assert rotator.per_layer and not torch.equal(rotator.inv_freq[0], rotator.inv_freq[1])
        reference = RopeRotator(model, rotator.inv_freq[1])  # the layer attended below: its frequencies alone
    else:
        rotator = reference = RopeRotator(make_tiny(arch), interleaved=arch == "cohere")
    torch.manual_seed(1)
    rows, heads, kv_heads, dim, q_len, layers = 4, 4, 2, 16, 3, 2
    query = torch.randn(rows, heads, q_len, dim)
    own_k, own_v = torch.randn(rows, kv_heads, 5, dim), torch.randn(rows, kv_heads, 5, dim)
    own_mask = torch.rand(rows, 1, q_len, 5) > 0.4
    own_mask[..., -1] = True  # every query sees at least its own key, as in a real prompt
    query_positions = torch.tensor([[11, 12, 13], [11, 12, 13], [5, 8, 12], [9, 10, 11]])
    parts = [
        SharedPart(torch.randn(layers, 2, kv_heads, 7, dim), torch.arange(0, 7), slice(0, 4)),
        SharedPart(torch.randn(layers, 2, kv_heads, 6, dim), torch.arange(7, 13), slice(0, 2), shift=3),
        SharedPart(torch.randn(layers, 2, kv_heads, 4, dim), torch.arange(7, 11), slice(2, 4), shift=-2),
        SharedPart(torch.randn(layers, 2, kv_heads, 3, dim), torch.arange(13, 16), (1, 3), shift=1),
    ]
    step = SharedKV(parts, heads_per_kv=heads // kv_heads, dtype=torch.float32, rotator=rotator).for_queries(query_positions)
    module = SimpleNamespace(layer_idx=1)
    out = split_attention(module, query, own_k, own_v, own_mask, dim**-0.5, step)  # type: ignore[arg-type]
    assert out.shape == (rows, q_len, heads, dim)

    for row in range(rows):
        keys, values, allowed = [own_k[row]], [own_v[row]], [own_mask[row, 0]]
        for part in parts:
            if row not in row_list(part.rows):
                continue
            moved = torch.empty_like(part.kv[1, 0])
            reference.rotate_into(moved, part.kv[1, 0], part.shift)  # where the prompt puts them
            keys.append(moved)
            values.append(part.kv[1, 1])
            allowed.append(part.positions[None, :] <= query_positions[row][:, None])
        expected = F.scaled_dot_product_attention(
            query[row : row + 1], torch.cat(keys, 1)[None], torch.cat(values, 1)[None],
            attn_mask=torch.cat(allowed, 1)[None, None], enable_gqa=True,
        )
        assert (out[row].transpose(0, 1) - expected[0]).abs().max().item() <= 1e-5


def test_share_prefixes_builds_the_prefix_tree_of_cached_segments():
    runs, private_from = share_prefixes([("s", "a"), ("s", "a"), ("s", "a", "b"), ("s", "c"), ("d",), ()])
    # "s" is shared by rows 0-3, "a" by rows 0-2; row 2's "b", row 3's "c" and row 4's "d" are their own
    assert runs == [SharedRun(slice(0, 4), 0, 1), SharedRun(slice(0, 3), 1, 2)]
    assert private_from == [2, 2, 2, 1, 0, 0]
    # a chain imported by the same rows is one run
    assert share_prefixes([("s", "a", "b"), ("s", "a", "b")]) == ([SharedRun(slice(0, 2), 0, 3)], [3, 3])
    assert share_prefixes([("s",)]) == ([], [0])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "smollm3", "cohere", "cohere2", "llama4"])
def test_zero_copy_assembly_equals_copying(make_engine, arch, monkeypatch):
    """Modules read where they are stored, moved ones too (queries rotated back, per layer where
    layers differ: those were copied and rotated), give the copying assembly's logits and tokens."""
    read_moved: list[int] = []
    original = assemble_mod.SharedPart

    def spy(kv, positions, rows, shift=0, *args, **kwargs):
        if shift:
            read_moved.append(shift)
        return original(kv, positions, rows, shift, *args, **kwargs)

    monkeypatch.setattr(assemble_mod, "SharedPart", spy)
    copying = make_engine(arch, recompute=4, assembly="copy")
    in_place = PromptCache(copying.model, copying.tokenizer, recompute=4, assembly="in_place", attention_temperature=1.0, attention_scale=1.0)
    for engine in (copying, in_place):
        names = engine.add_documents(DOCS, progress=False)
    prompts = [
        build_prompt("When was the lighthouse automated?", names),  # the first document exact, the others moved
        build_prompt("How long is the road?", names[2:]),
        "\n\n".join(DOCS[1:]) + "\n\nSummary:",  # drop-in: documents found in plain text
    ]
    for prompt in prompts:
        assert (copying.next_token_logits(prompt) - in_place.next_token_logits(prompt)).abs().max().item() <= 1e-5
        assert in_place.generate(prompt, max_new_tokens=8).token_ids == copying.generate(prompt, max_new_tokens=8).token_ids
    assert read_moved  # moved documents were read in place, not copied


def test_zero_copy_assembly_on_the_embedded_model(smollm):
    in_place = PromptCache(smollm.model, smollm.tokenizer, assembly="in_place")
    for engine in (smollm, in_place):
        names = engine.add_documents(DOCS, progress=False)
    prompt = build_prompt("How often do ferries leave in winter?", names)
    assert (smollm.next_token_logits(prompt) - in_place.next_token_logits(prompt)).abs().max().item() <= 1e-4
    assert in_place.generate(prompt, max_new_tokens=16).token_ids == smollm.generate(prompt, max_new_tokens=16).token_ids


def _spy_runs(monkeypatch) -> list[list[SharedRun]]:
    seen: list[list[SharedRun]] = []
    original = assemble_mod.share_prefixes

    def spy(signatures):
        runs, private_from = original(signatures)
        seen.append(runs)
        return runs, private_from

    monkeypatch.setattr(assemble_mod, "share_prefixes", spy)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "smollm3", "cohere", "cohere2", "llama4"])
def test_a_batch_shares_what_its_prompts_import_at_the_same_positions(make_engine, arch, monkeypatch):
    engine = make_engine(arch, recompute=4)
    names = engine.add_documents(DOCS, progress=False)
    prompts = [
        build_prompt("When was the lighthouse automated?", names[:3]),
        build_prompt("How often do ferries leave?", names[:3]),
        build_prompt("Who teaches the children?", names[:2]),  # shares only a prefix of the others' documents
        build_prompt("How long is the road?", names[3:]),  # its document sits where nobody else's does
    ]
    seen = _spy_runs(monkeypatch)
    shared = engine.generate_batch(prompts, max_new_tokens=10)
    naive = engine.generate_batch(prompts, max_new_tokens=10, share_modules=False)
    sequential = [engine.generate(p, max_new_tokens=10) for p in prompts]
    assert [r.token_ids for r in shared] == [r.token_ids for r in sequential] == [r.token_ids for r in naive]
    assert [r.stats.cached_tokens for r in shared] == [r.stats.cached_tokens for r in sequential]
    (runs,) = seen
    rows = sorted((run.rows.stop - run.rows.start) for run in runs)
    # the system prompt (all four), the first two documents (three prompts), the third (two)
    assert rows == [2, 3, 4]


def test_batched_prefill_is_one_forward_pass(smollm):
    names = smollm.add_documents(DOCS, progress=False)
    prompts = [build_prompt(q, names) for q in ("Who teaches?", "When was the lighthouse automated?", "How long is the road?")]
    sequential = [smollm.generate(p, max_new_tokens=12) for p in prompts]
    passes = smollm.forward.passes
    batched = smollm.generate_batch(prompts, max_new_tokens=12)
    assert [r.token_ids for r in batched] == [r.token_ids for r in sequential]
    assert smollm.forward.passes - passes <= max(len(r.token_ids) for r in sequential)  # 1 prefill + steps after the first token


def test_assembly_is_checked(make_engine):
    with pytest.raises(PromptCacheError, match="assembly must be"):
        make_engine("llama", assembly="mmap")
    with pytest.raises(PromptCacheError, match="needs a RoPE model on sdpa"):
        make_engine("bloom", assembly="in_place")
    assert make_engine("bloom").assembly == "copy"


def test_eager_attention_batches_without_sharing(make_tiny, tokenizer):
    model = make_tiny("llama")
    model.set_attn_implementation("eager")
    engine = PromptCache(model, tokenizer, recompute=0)
    assert not engine.split
    names = engine.add_documents(DOCS[:2], progress=False)
    prompts = [build_prompt("Lighthouse?", names), build_prompt("Ferries?", names)]
    assert [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=6)] == [
        engine.generate(p, max_new_tokens=6).token_ids for p in prompts
    ]


@pytest.mark.parametrize("share_modules", [True, False])
def test_garbage_in_padding_never_reaches_an_answer(make_engine, monkeypatch, share_modules):
    """Masked entries still meet the values in a product (weight 0): fresh buffers are filled
    with NaN here, as uninitialised memory can be, and batched answers must not change."""
    from pc_rag.kv.buffers import KVBuffer

    engine = make_engine("llama", recompute=4)
    names = engine.add_documents(DOCS, progress=False)
    prompts = [build_prompt("Lighthouse?", names[:3]), build_prompt("Who teaches the children there?", names[:2]), "Hi"]
    expected = [engine.generate(p, max_new_tokens=8).token_ids for p in prompts]
    original = KVBuffer.__init__

    def poisoned(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.storage.fill_(float("nan"))

    monkeypatch.setattr(KVBuffer, "__init__", poisoned)
    assert [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=8, share_modules=share_modules)] == expected


@pytest.mark.parametrize("dtype,masked", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)])
def test_cuda_fused_kernels_return_out_and_lse_in_the_merge_layout(dtype, masked):
    """The CUDA branch (flash without a mask, memory-efficient with one) through the kernels' own
    shape logic on the meta device: ``out [b, h, m, d]`` and ``lse [b, h, m]`` (the efficient
    kernel pads its log-sum-exp to 32 queries and wants 16-aligned bias rows). The numbers need a
    GPU: no GPU was lent to this project, so only the shapes and the dispatch are checked here."""
    from pc_rag.forward.shared_attention import fused_attention_with_lse

    query = torch.empty(1, 3, 40, 64, device="meta", dtype=dtype)
    key = torch.empty(1, 3, 100, 64, device="meta", dtype=dtype)
    bias = torch.empty(1, 1, 40, 100, device="meta", dtype=dtype) if masked else None
    out, lse = fused_attention_with_lse(query, key, key, 0.125, bias)
    assert out.shape == (1, 3, 40, 64) and lse.shape == (1, 3, 40)
