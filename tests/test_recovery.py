"""Recovery: recomputing the head (EPIC-style) and the tail of each imported module behind what precedes it.

Recomputing every token of every module, from either end, must give exactly full prefill (the
one-pass prefill with a position mask is the same computation); recomputing a few must move the
logits towards full prefill; models that cannot take it say so.
"""

from __future__ import annotations

import pytest
import torch

from pc_rag import PML, PromptCache, PromptCacheError, build_prompt
from pc_rag.engine import DEFAULT_RECOMPUTE, DEFAULT_RECOMPUTE_TAIL

DOCS = [
    "The river Elbe rises in the Krkonose mountains and flows north-west to the North Sea near Hamburg.",
    "Hamburg is a port city whose harbour handles container ships from every continent, day and night.",
    "Container shipping grew after 1956, when standard boxes made loading cranes far faster than before.",
]
QUESTION = "Where does the river reach the sea?"
SCHEMA = """<schema name="kb"><system>Answer briefly.</system><user>
<module name="a">Alpha is the first letter of the Greek alphabet and starts many words.</module>
Between the modules.
<module name="b">Beta follows alpha; it is the second letter and names a software stage.</module>
</user></schema>"""


def _logits(engine: PromptCache, prompt: str, use_cache: bool = True) -> torch.Tensor:
    return engine.next_token_logits(prompt, use_cache=use_cache)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("encoding", ["shared_prefix", "isolated"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("head, tail", [(10_000, 1), (0, 10_000)])
def test_recomputing_everything_is_full_prefill(make_tiny, tokenizer, arch, encoding, attn, head, tail):
    engine = PromptCache(make_tiny(arch, attn_implementation=attn), tokenizer, encoding=encoding, recompute=head, recompute_tail=tail)
    names = engine.add_documents(DOCS, progress=False)
    engine.add_schema(SCHEMA, progress=False)
    prompts = [
        build_prompt(QUESTION, names),
        PML('<prompt schema="kb"><a/><b/><user>Which is second?</user></prompt>'),  # text between modules
    ]
    if head:  # a drop-in document ends with its text, not its module's end: only its head is recomputed
        prompts.append("\n\n".join(DOCS) + "\n\n" + QUESTION)
    for prompt in prompts:
        plan = engine.plan(prompt)
        assert len(plan.modules) >= 2
        assert plan.cached_tokens > 0 or prompt == prompts[-1]  # the prefix stays cached (the drop-in prompt has none)
        # cached: the prefix, and under shared_prefix a module where, and behind what, it was encoded (exact):
        # module a right behind the schema prefix, the first document behind the system turn and user marker
        exact = {"a", names[0]} if encoding == "shared_prefix" else set()
        assert {s.owner for s in plan.segments if s.cached} <= {"#0"} | exact
        torch.testing.assert_close(_logits(engine, prompt), _logits(engine, prompt, use_cache=False), atol=1e-4, rtol=1e-4)


def test_a_few_recomputed_tokens_move_towards_full_prefill(make_tiny, tokenizer):
    model = make_tiny("llama")
    distances = []
    for head, tail in ((0, 0), (4, 0), (0, 2), (12, 4)):
        engine = PromptCache(model, tokenizer, recompute=head, recompute_tail=tail)
        prompt = build_prompt(QUESTION, engine.add_documents(DOCS, progress=False))
        plan = engine.plan(prompt)
        documents = sum(len(engine.schemas["docs"].layout.modules[n].token_ids) for n in plan.modules)
        # the first document follows the system turn and the user marker, as when it was encoded: exact
        assert plan.cached_tokens == engine.schemas["docs"].layout.prefix_length + documents - (head + tail) * (len(DOCS) - 1)
        distances.append((_logits(engine, prompt) - _logits(engine, prompt, use_cache=False)).abs().max().item())
    assert distances[3] < distances[0]


def test_tail_tokens_are_computed_where_they_stand(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama"), tokenizer, recompute=3, recompute_tail=2)
    names = engine.add_documents(DOCS, progress=False)
    plan = engine.plan(build_prompt(QUESTION, names))
    modules = engine.schemas["docs"].layout.modules
    for name in names[1:]:  # moved documents: head computed, body cached, tail computed
        tokens = modules[name].token_ids
        body = next(s for s in plan.segments if s.owner == name)
        index = plan.segments.index(body)
        head, tail = plan.segments[index - 1], plan.segments[index + 1]
        assert not head.cached and head.token_ids == tuple(tokens[:3]) and head.position + 3 == body.position
        assert (body.offset, len(body)) == (3, len(tokens) - 5)
        assert not tail.cached and tail.token_ids == tuple(tokens[-2:]) and tail.position == body.position + len(body)
    # a document's tail is its separator: the text between documents in full prefill
    assert tuple(tokens[-len(engine.separator_ids):]) == tuple(engine.separator_ids)
    # a document quoted into plain text is reused up to the end of its text, without its separator (the
    # text between documents is computed there): its last cached token is the text's, and no tail is cut
    quoted = engine.plan(engine.render_chat([{"role": "user", "content": DOCS[1] + "\n\n" + DOCS[2] + "\n\n" + QUESTION}]))
    ends = [(s.owner, s.offset + len(s)) for s in quoted.segments if s.cached and s.owner in names]
    assert ends == [(name, modules[name].text_tokens) for name in names[1:]]


def test_first_module_right_after_the_prefix_is_left_alone(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama"), tokenizer, recompute=4)
    engine.add_schema(SCHEMA.replace("<user>", "").replace("</user>", ""), progress=False)
    plan = engine.plan(PML('<prompt schema="kb"><a/><b/>Which?</prompt>'))
    heads = [s for s in plan.segments if s.cached and s.owner == "a"]
    assert heads and heads[0].offset == 0  # module a is where it was encoded, right behind the prefix: exact
    assert [s.offset for s in plan.segments if s.cached and s.owner == "b"] == [4]


def test_defaults_and_refusals(make_tiny, tokenizer):
    llama = PromptCache(make_tiny("llama"), tokenizer)
    assert (llama.recompute, llama.recompute_tail) == (DEFAULT_RECOMPUTE, DEFAULT_RECOMPUTE_TAIL)
    for arch in ("gpt2", "bloom"):  # learned positions: nothing moves; ALiBi reads buffer order
        engine = PromptCache(make_tiny(arch), tokenizer)
        assert (engine.recompute, engine.recompute_tail) == (0, 0)
    with pytest.raises(PromptCacheError, match="recompute needs a RoPE model"):
        PromptCache(make_tiny("bloom"), tokenizer, recompute=8)
    with pytest.raises(PromptCacheError, match="recompute_tail needs a RoPE model"):
        PromptCache(make_tiny("bloom"), tokenizer, recompute_tail=1)
    with pytest.raises(PromptCacheError, match="recompute must be"):
        PromptCache(make_tiny("llama"), tokenizer, recompute=-1)
    with pytest.raises(PromptCacheError, match="recompute_tail must be"):
        PromptCache(make_tiny("llama"), tokenizer, recompute_tail=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_document_after_the_user_marker_is_exact_without_recovery(make_tiny, tokenizer, arch):
    """Documents are encoded behind the system turn and the user marker, where build_prompt puts them."""
    engine = PromptCache(make_tiny(arch), tokenizer, recompute=0)
    prompt = build_prompt(QUESTION, engine.add_documents(DOCS[:1], progress=False))
    assert engine.plan(prompt).cached_tokens > len(DOCS[0]) // 8
    torch.testing.assert_close(_logits(engine, prompt), _logits(engine, prompt, use_cache=False), atol=1e-4, rtol=1e-4)
