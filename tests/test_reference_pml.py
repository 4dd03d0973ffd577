"""Schemas written for the reference implementation (yale-sys/prompt-cache) run unchanged.

They use ``scaffold=`` on ``<union>`` (the member that stands for the union when the schema is
encoded jointly) and on ``<parameter>`` (the slot's text when no argument is given),
``cache="false"`` on ``<module>`` (computed at serve time), ``length=``, module names scoped by
their parent (every union may hold a ``default``) and XML comments. ``encoding="scaffold"`` is
the reference's joint encoding: every module is encoded behind all the schema text before it.
"""

from __future__ import annotations

import pytest
import torch

from pc_rag import PML, PromptCache, PromptCacheError
from pc_rag.prompt.pml import ModuleNode, ParamNode, UnionNode, parse_schema

# written in the reference's style (its benchmark/schema_persona.xml shape), with our own text
PERSONA = """<!-- scenario: 1 -->
<schema name="persona">
    <system>Below are dialogues between people and an AI assistant that tries to be helpful and honest.</system>
    <module name="age">
        <union scaffold="default">
            <module name="default">User prompt will be provided here.</module>
            <module name="child">This person is between 0 and 12 years old and depends on their parents.</module>
            <module name="senior">This person is 55 or older and may be retired, with grown children and a garden.</module>
        </union>
    </module>
    <module name="residence">
        <union scaffold="default">
            <module name="default">User prompt will be provided here.</module>
            <module name="seaside">This person lives near the sea, with beaches, ferries and stormy winters.</module>
        </union>
    </module>
    <module name="greeting">Say hello to <parameter name="who" length="8" scaffold="the reader"/> first.</module>
    <module name="today" cache="false">Today is a quiet day.</module>
</schema>"""


def _nodes(nodes, kind):
    for node in nodes:
        if isinstance(node, kind):
            yield node
        yield from _nodes(getattr(node, "children", None) or getattr(node, "members", None) or [], kind)


def test_reference_attributes_parse():
    doc = parse_schema(PERSONA)
    assert doc.name == "persona"
    assert [u.scaffold for u in _nodes(doc.children, UnionNode)] == ["default", "default"]
    assert [(p.name, p.length, p.scaffold) for p in _nodes(doc.children, ParamNode)] == [("who", 8, "the reader")]
    assert {m.name: m.cache for m in _nodes(doc.children, ModuleNode)}["today"] is False


@pytest.fixture(params=["isolated", "shared_prefix", "scaffold"])
def engine(request, make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama", seed=5), tokenizer, encoding=request.param, recompute=0, recompute_tail=0)
    engine.add_schema(PERSONA, progress=False)
    return engine


def test_the_reference_schema_runs(engine):
    schema = engine.schemas["persona"]
    # names are scoped by their parent: two unions each hold a "default"
    assert {"age/default", "residence/default", "age/senior"} <= set(schema.modules)
    assert "today" not in schema.keys  # cache="false": never stored
    plan = engine.plan(PML('<prompt schema="persona"><age><senior/></age><residence><default/></residence><greeting/><today/> Hi!</prompt>'))
    assert plan.modules == ["senior", "default", "greeting", "today"]  # modules with text of their own
    computed = engine.tokenizer.decode([t for s in plan.segments if not s.cached for t in s.token_ids])
    assert "Today is a quiet day." in computed  # computed at serve time
    cached = engine.tokenizer.decode([t for s in plan.segments if s.cached for t in s.token_ids])
    assert "the reader" in cached  # the parameter's scaffold stands in for the missing argument
    with_argument = engine.plan(PML('<prompt schema="persona"><greeting who="Ada"/> Hi!</prompt>'))
    assert "Ada" in engine.tokenizer.decode(with_argument.input_ids) and "reader" not in engine.tokenizer.decode(with_argument.input_ids)
    assert engine.generate(PML('<prompt schema="persona"><age><child/></age> Hi!</prompt>'), max_new_tokens=3).stats.cached_tokens > 0


@pytest.mark.parametrize("schema, message", [
    ('<schema name="s"><union scaffold="nope"><module name="a">A text.</module></union></schema>', "union scaffold 'nope'"),
    ('<schema name="s"><module name="a" cache="maybe">A text.</module></schema>', 'cache must be "true" or "false"'),
    ('<schema name="s"><module name="a">Hi <parameter name="p" length="2" scaffold="far too many words here"/></module></schema>',
     "scaffold of parameter 'p'"),
])
def test_bad_reference_attributes_are_clear_errors(make_engine, schema, message):
    with pytest.raises(PromptCacheError, match=message):
        make_engine("llama").add_schema(schema, progress=False)


# the reference's placeholder: an empty (whitespace-only, across lines) union member, "nothing here"
PLACEHOLDER = """<schema name="ph"><system>Answer briefly.</system>
<module name="style">
  <union scaffold="default">
    <module name="default">
    </module>
    <module name="formal">Write formally, in complete sentences, and avoid contractions.</module>
  </union>
</module>
<module name="note">The harbour opens at six in the morning and closes at ten at night.</module>
</schema>"""


@pytest.mark.parametrize("encoding", ["isolated", "shared_prefix", "scaffold"])
def test_an_empty_union_member_is_a_placeholder(make_tiny, tokenizer, encoding):
    engine = PromptCache(make_tiny("llama", seed=5), tokenizer, encoding=encoding, recompute=0, recompute_tail=0)
    engine.add_schema(PLACEHOLDER, progress=False)
    empty = engine.plan(PML('<prompt schema="ph"><style><default/></style><note/> When does the harbour open?</prompt>'))
    without = engine.plan(PML('<prompt schema="ph"><note/> When does the harbour open?</prompt>'))
    assert empty.input_ids == without.input_ids  # the placeholder imports nothing
    formal = engine.plan(PML('<prompt schema="ph"><style><formal/></style><note/> When does the harbour open?</prompt>'))
    assert "Write formally" in engine.tokenizer.decode(formal.input_ids)
    for prompt in ('<prompt schema="ph"><style><default/></style><note/> Q?</prompt>', '<prompt schema="ph"><style><formal/></style><note/> Q?</prompt>'):
        assert engine.generate(PML(prompt), max_new_tokens=3).stats.cached_tokens > 0
    with pytest.raises(PromptCacheError, match="module 'lonely' is empty"):  # outside a union it is a mistake
        engine.add_schema('<schema name="bad"><module name="lonely">\n</module></schema>', progress=False)


JOINT = """<schema name="kb"><system>Answer from the notes.</system><user>
<module name="a">The harbour opens at six in the morning and closes at ten at night.</module>
Between the notes.
<union scaffold="long">
<module name="short">Ferries leave hourly.</module>
<module name="long">Ferries leave every hour in summer and every two hours in winter, weather permitting.</module>
</union>
<module name="b">The lighthouse was automated in 1987 and flashes every ten seconds.</module>
</user></schema>"""


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_joint_encoding_along_the_scaffold_is_full_prefill(make_tiny, tokenizer, arch):
    """A prompt that follows the scaffold path reads KV computed behind exactly what precedes it:
    cached inference is full prefill, with nothing recomputed (recovery finds every module exact)."""
    engine = PromptCache(make_tiny(arch), tokenizer, encoding="scaffold")  # default recovery on
    engine.add_schema(JOINT, progress=False)
    prompt = PML('<prompt schema="kb"><a/><long/><b/><user>When does the harbour open?</user></prompt>')
    plan = engine.plan(prompt)
    assert plan.computed_tokens < 20 and all(s.offset == 0 or not s.cached for s in plan.segments)
    torch.testing.assert_close(engine.next_token_logits(prompt), engine.next_token_logits(prompt, use_cache=False), atol=1e-4, rtol=1e-4)
    # the other member was encoded on a path of its own, behind the same text: exact too
    other = PML('<prompt schema="kb"><a/><short/><user>How often do ferries leave?</user></prompt>')
    torch.testing.assert_close(engine.next_token_logits(other), engine.next_token_logits(other, use_cache=False), atol=1e-4, rtol=1e-4)
    # isolated modules are not: the joint encoding is what buys the fidelity
    isolated = PromptCache(engine.model, tokenizer, encoding="isolated", recompute=0, recompute_tail=0)
    isolated.add_schema(JOINT, progress=False)
    assert (isolated.next_token_logits(prompt) - engine.next_token_logits(prompt, use_cache=False)).abs().max().item() > 1e-3


def test_joint_encoding_is_one_pass_per_path_and_persists(make_tiny, tokenizer, tmp_path):
    model = make_tiny("llama")
    first = PromptCache(model, tokenizer, encoding="scaffold", kv_dir=tmp_path)
    first.add_schema(JOINT, progress=False)
    assert first.forward.encoded == 2  # the default path, and the path through the other member
    again = PromptCache(model, tokenizer, encoding="scaffold", kv_dir=tmp_path)
    again.add_schema(JOINT, progress=False)
    prompt = PML('<prompt schema="kb"><a/><short/><b/> Why?</prompt>')
    assert again.generate(prompt, max_new_tokens=4).token_ids == first.generate(prompt, max_new_tokens=4).token_ids
    assert again.forward.encoded == 0 and again.store.disk_loads > 0  # loaded, never encoded again
