"""The reference implementation's own PML files, and the ones its generators write, run here.

The files under ``tests/reference_pml/`` come from yale-sys/prompt-cache (see ORIGIN.md there).
The reference substitutes role tags as text before it parses, so its files open a turn in a
schema and close it in the prompt (LongBench), import several members of one union (its SQuAD v2
test) and leave ``<system/>`` bare; each is read here with the reference's meaning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pc_rag import PML, PromptCache, PromptCacheError
from pc_rag.prefill.recovery import moved

FILES = Path(__file__).parent / "reference_pml"
RUNS = ["empty.xml", "schema_mbti_short.xml", "schema_mbti.xml", "schema_persona.xml", "code_generation_bookstore.xml",
        "parameterized_prompts.xml", "squadv2test.xml", "generated_squad_v2.xml", "generated_ms_marco.xml", "generated_union.xml"]


@pytest.fixture(scope="module")
def model(tokenizer):
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(tiny_config("llama", len(tokenizer), max_position_embeddings=16384), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    engine = PromptCache(model, tokenizer, encoding="scaffold")
    for name in RUNS:
        engine.add_schema((FILES / name).read_text(), progress=False)
    return engine


def _text(engine: PromptCache, prompt: str) -> str:
    return engine.tokenizer.decode(engine.plan(PML(prompt)).input_ids)


def test_every_reference_schema_is_taken(engine):
    assert {"empty", "mbti", "persona", "travel", "squadv2", "schema_squad_style", "schema_marco_style", "schema_union_style"} <= set(engine.schemas)


def test_the_reference_mbti_prompt_runs(engine):
    prompt = (FILES / "prompt_mbti.xml").read_text()
    text = _text(engine, prompt)
    # each chosen union member's text, in schema order, inside the one user turn of the schema
    at = [text.index(f"({trait})") for trait in ("E", "N", "T", "P")]
    assert at == sorted(at) and "Introversion is characterized" not in text and text.count("<|im_start|>user") == 1
    assert engine.generate(PML(prompt), max_new_tokens=3).stats.cached_tokens > 0


@pytest.mark.parametrize("name, message", [
    # the reference rejects it too ("Scaffold for parameter ... is too long"): 6 tokens here
    ("schema_code_generation.xml", "scaffold of parameter 'param-name' is 6 tokens, longer than the parameter"),
    # an old version: four top-level unions each hold a "default" (later versions scope them)
    ("schema_mbti_235bde0.xml", "duplicate module name 'default'"),
])
def test_reference_files_we_refuse_say_why(make_engine, name, message):
    with pytest.raises(PromptCacheError, match=message):
        make_engine().add_schema((FILES / name).read_text(), progress=False)


# LongBench (benchmark/longbench.py): the schema opens <user> and its prompt closes it, then opens
# <assistant> with the answer's first words and ends inside it
LONGBENCH_SCHEMA = """
<schema name="schema_lb1">
<system/>
<user><module name="context">
Read the story below and answer the question.\n\nThe keeper rowed to the lighthouse every evening at dusk.
</module>
</schema>
"""
LONGBENCH_PROMPT = """
                <prompt schema='schema_lb1'>
                <context/>
                Question: who rowed to the lighthouse?\n\nAnswer:</user><assistant>Answer:</prompt>
                """


@pytest.mark.parametrize("encoding", ["isolated", "shared_prefix", "scaffold"])
def test_a_turn_opened_in_the_schema_is_closed_by_the_prompt(model, tokenizer, encoding):
    engine = PromptCache(model, tokenizer, encoding=encoding)
    engine.add_schema(LONGBENCH_SCHEMA, progress=False)
    markers = engine.markers
    text = _text(engine, LONGBENCH_PROMPT)
    # <system/> is the template's own opening without a system prompt (SmolLM2 writes a default one)
    assert markers.no_system.startswith("<|im_start|>system\n") and text.startswith(markers.no_system + markers.starts["user"])
    assert text.count(markers.starts["user"]) == 1 and text[len(markers.no_system):].count(markers.ends["user"]) == 1
    # the prompt ends inside the assistant turn it opened: no generation prompt after it
    assert text.endswith(markers.ends["user"] + markers.starts["assistant"] + "Answer:")
    full = tokenizer.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False)
    assert text.startswith(full.split("X")[0])
    if encoding == "scaffold":  # the module was encoded behind exactly the opening: exact
        torch.testing.assert_close(engine.next_token_logits(PML(LONGBENCH_PROMPT)),
                                   engine.next_token_logits(PML(LONGBENCH_PROMPT), use_cache=False), atol=1e-4, rtol=1e-4)


def test_a_module_may_close_a_turn_opened_before_it(make_engine):
    engine = make_engine()
    engine.add_schema('<schema name="s"><user>Read this. <module name="doc">The keeper rowed out at dusk.</user></module>'
                      '<module name="after">Never mind.</module></schema>', progress=False)
    markers = engine.markers
    text = _text(engine, '<prompt schema="s"><doc/><user>Who rowed?</user></prompt>')
    assert text.index("Read this.") < text.index("at dusk." + markers.ends["user"]) < text.index(markers.starts["user"] + "Who rowed?")
    assert text.endswith(markers.generation)


@pytest.mark.parametrize("schema, prompt, message", [
    ('<schema name="s"><user>Hi <module name="m">M.</module></user></schema>', '<prompt schema="s"><m/>Q</assistant></prompt>',
     "</assistant> closes no <assistant> turn: no turn is open"),
    ('<schema name="s"><user><module name="m">M.</module></schema>', '<prompt schema="s"><m/><user>Q</user></prompt>',
     "<user> opens a turn inside the <user> turn opened by the schema"),
    ('<schema name="s"><user>A<assistant>B</assistant></user></schema>', None, "<assistant> opens a turn inside the <user> turn opened at line 1"),
    ('<schema name="s"><user>A</assistant></schema>', None, "</assistant> closes no <assistant> turn: the open turn is <user>"),
    ('<schema name="s"><union><module name="a">A</user></module><module name="b">B</module></union></schema>', None,
     "</user> closes no <user> turn"),
    ('<schema name="s"><user>x</user><union><module name="a">A<assistant></module><module name="b">B</module></union></schema>', None,
     "the members of this <union> leave different turns open"),
    ('<schema name="s"><user role="x"><module name="m">M.</module></schema>', None, "<user> does not take attribute"),
])
def test_turns_out_of_order_are_clear_errors(make_engine, schema, prompt, message):
    engine = make_engine()
    with pytest.raises(PromptCacheError, match=message):
        engine.add_schema(schema, progress=False)
        engine.plan(PML(prompt))


# its SQuAD v2 test (main.py at ab7daa0): seven members of one union, then a user turn
SQUAD_PROMPT = "<prompt schema='squadv2'><contexts>" + "".join(f"<document{i}/>" for i in range(7)) + \
    "</contexts><user>Where was Beyonce born?</user></prompt>"


def test_several_members_of_one_union_run_with_a_warning(engine, caplog):
    with caplog.at_level(logging.WARNING, logger="pc_rag.prompt.layout"):
        plan = engine.plan(PML(SQUAD_PROMPT))
    assert "members of the same <union>" in caplog.text
    text = engine.tokenizer.decode(plan.input_ids)
    # a RoPE model places them one after the other, as full prefill of the same text reads them
    starts = [text.index(snippet) for snippet in ("Beyoncé Giselle Knowles-Carter (/", "Following the disbandment", "A self-described")]
    assert starts == sorted(starts)
    torch.testing.assert_close(engine.next_token_logits(PML(SQUAD_PROMPT)).argmax(), engine.next_token_logits(PML(SQUAD_PROMPT), use_cache=False).argmax())


def test_several_members_share_positions_on_a_pinned_model(make_tiny, tokenizer):
    """Learned absolute positions: the members keep their schema positions, all at the union's
    start (the reference's placement), and the request runs."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=8192, bos_token_id=None, eos_token_id=None)
    engine = PromptCache(AutoModelForCausalLM.from_config(config).eval(), tokenizer)
    engine.add_schema((FILES / "squadv2test.xml").read_text(), progress=False)
    plan = engine.plan(PML(SQUAD_PROMPT))
    members = [s for s in plan.segments if s.cached and s.owner.startswith("contexts/document")]
    assert len({s.owner for s in members}) == 7 and len({s.position for s in members if s.offset == 0}) == 1
    assert engine.generate(PML(SQUAD_PROMPT), max_new_tokens=2).stats.cached_tokens > 0


def test_generated_schemas_run_with_their_generators_prompts(engine):
    for prompt in ("<prompt schema='schema_squad_style'><context/><user>When does the harbour open?</user></prompt>",
                   "<prompt schema='schema_marco_style'><document_0/><user>Summarize. Query: \"lighthouse\"</user></prompt>",
                   "<prompt schema='schema_union_style'><doc_a/><user>How many children?</user></prompt>"):
        assert engine.generate(PML(prompt), max_new_tokens=2).stats.cached_tokens > 0


# ------------------------------------------------------------------------------------------------
# Joint ("scaffold") encoding with several unions: exact on a path, recovered off it
# ------------------------------------------------------------------------------------------------
TWO_UNIONS = """<schema name="two"><system>Describe the person.</system><user>
<module name="age"><union scaffold="default">
<module name="default">Age is not given.</module>
<module name="child">This person is nine years old and goes to school.</module>
</union></module>
<module name="home"><union scaffold="default">
<module name="default">Home is not given.</module>
<module name="coast">This person lives by the sea in a fishing town.</module>
</union></module>
</user></schema>"""


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_scaffold_is_exact_on_a_path_and_recovers_off_it(make_tiny, tokenizer, arch):
    """The exact condition: every imported module follows exactly the text it was encoded behind,
    i.e. the prompt, up to its last module, is a prefix of one path (every union at its scaffold
    member but at most one). Choosing off the scaffold in two unions is not a path: the second
    member was encoded behind the first union's scaffold member, and the planner says so."""
    model = make_tiny(arch, seed=2)
    engine = PromptCache(model, tokenizer, encoding="scaffold")  # default recovery: anonymous text after a union
    engine.add_schema(TWO_UNIONS, progress=False)                 # (the turn's end) is encoded on the default path
    on_path = PML('<prompt schema="two"><age><default/></age><home><coast/></home><user>Where?</user></prompt>')
    torch.testing.assert_close(engine.next_token_logits(on_path), engine.next_token_logits(on_path, use_cache=False), atol=1e-4, rtol=1e-4)
    one_choice = PML('<prompt schema="two"><age><child/></age><user>How old?</user></prompt>')
    torch.testing.assert_close(engine.next_token_logits(one_choice), engine.next_token_logits(one_choice, use_cache=False), atol=1e-4, rtol=1e-4)
    two_choices = PML('<prompt schema="two"><age><child/></age><home><coast/></home><user>Where?</user></prompt>')
    engine = PromptCache(model, tokenizer, encoding="scaffold", recompute=0, recompute_tail=0)
    engine.add_schema(TWO_UNIONS, progress=False)
    planned = engine.plan(two_choices)
    flags = dict(zip([s.owner for s in planned.segments], moved(planned, "scaffold")))
    assert flags["age/child"] is False and flags["home/coast"] is True
    off = engine.next_token_logits(two_choices) - engine.next_token_logits(two_choices, use_cache=False)
    assert off.abs().max().item() > 1e-3  # what recovery (on by default) is for
