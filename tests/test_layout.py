"""Schema positions (paper §3.3) and prompt plans: what is cached, computed, and where."""

import pytest

from pc_rag import PromptCacheError, parse_prompt, parse_schema
from pc_rag.prompt.layout import ChatMarkers, layout_schema
from pc_rag.prompt.plan import plan_prompt

MARKERS = ChatMarkers({"system": "[S]", "user": "[U]", "assistant": "[A]"}, {"system": "[/S]", "user": "[/U]", "assistant": "[/A]"}, "[A]")


def tokenize(text: str) -> list[int]:
    """One token per character: positions are easy to read in assertions."""
    return [ord(c) for c in text]


SCHEMA = """<schema name="trip">[S]sys[/S]<module name="plan">go <param name="days" len="4"/> days<union>
<module name="near">ab</module>
<module name="far">abcdef<module name="tokyo">TK</module></module>
</union>
</module>
<module name="tail">zz</module>
</schema>"""


def layout(source=SCHEMA, bos=()):
    return layout_schema(parse_schema(source), tokenize, MARKERS, placeholder_id=0, bos_ids=bos)


def plan(prompt, compact=True, source=SCHEMA):
    return plan_prompt(layout(source), parse_prompt(prompt), tokenize, MARKERS, compact=compact)


def test_schema_positions_follow_the_paper():
    lay = layout()
    m = lay.modules
    assert "".join(map(chr, m["#0"].token_ids)) == "[S]sys[/S]"
    assert m["#0"].positions == list(range(0, 10))
    # "go " at 10..12, 4 placeholder slots 13..16, " days" 17..21
    assert m["plan"].positions == list(range(10, 22))
    assert m["plan"].params["days"].offset == 3 and m["plan"].token_ids[3:7] == [0, 0, 0, 0]
    # union members share a start; the union is as long as its longest member (far + tokyo = 8)
    # (nested modules are known by their path: names are scoped by their parent)
    assert m["plan/near"].positions[0] == m["plan/far"].positions[0] == 22
    assert m["plan/far/tokyo"].positions == [28, 29]
    assert m["tail"].positions == [30, 31]
    assert lay.length == 32 and lay.prefix == "#0"
    assert m["plan/far/tokyo"].parent == "plan/far" and m["plan/near"].union == m["plan/far"].union is not None


def test_bos_opens_the_first_anonymous_run():
    lay = layout('<schema name="s"><module name="m">x</module></schema>', bos=[1])
    assert lay.modules["#0"].token_ids == [1] and lay.modules["m"].positions == [1]


def test_plan_schema_positions_with_args_gaps_and_text():
    p = plan('<prompt schema="trip"><plan days="3"><far/></plan>Q?</prompt>', compact=False)
    rows = [(s.cached, "".join(map(chr, s.token_ids)), s.position) for s in p.segments]
    assert rows == [
        (True, "[S]sys[/S]", 0),
        (True, "go ", 10),
        (False, "3", 13),  # the argument takes the parameter's first slot; unused slots are left out
        (True, " days", 17),
        (True, "abcdef", 22),
    ] + [(False, "Q?", 28)]  # uncached text continues after the token before it
    assert p.modules == ["plan", "far"]


def test_plan_compact_positions_are_contiguous_and_record_the_source():
    p = plan('<prompt schema="trip"><plan days="3"><far><tokyo/></far></plan><tail/>Q?</prompt>')
    assert p.position_ids == list(range(len(p.input_ids)))
    assert "".join(map(chr, p.input_ids)) == "[S]sys[/S]go 3 daysabcdefTKzzQ?"
    moved = {s.owner: (s.position, s.source_position) for s in p.segments if s.cached}
    assert moved["#0"] == (0, 0)
    assert moved["plan/far"] == (19, 22)  # 3 unused slots closed up (a segment's owner is the module's path)
    assert moved["tail"] == (27, 30)
    assert p.cached_tokens == len(p.input_ids) - 3 and p.computed_tokens == 3


def test_text_goes_before_the_next_import_after_the_schema_text_before_it():
    p = plan('<prompt schema="trip">intro <plan/>mid <tail/>end</prompt>')
    texts = ["".join(map(chr, s.token_ids)) for s in p.segments]
    assert texts[:3] == ["[S]sys[/S]", "intro ", "go "]
    assert "mid " in texts and texts.index("mid ") == texts.index("zz") - 1


def test_last_token_is_always_computed():
    p = plan('<prompt schema="trip"><tail/></prompt>')
    assert not p.segments[-1].cached and len(p.segments[-1]) == 1
    assert "".join(map(chr, p.input_ids)) == "[S]sys[/S]zz"


def test_roles_in_prompt_add_the_generation_prompt():
    p = plan('<prompt schema="trip"><tail/><user>Q</user></prompt>')
    assert "".join(map(chr, p.input_ids)).endswith("zz[U]Q[/U][A]")


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ('<prompt schema="trip"><plam/></prompt>', "unknown module <plam/> in schema 'trip'; did you mean: plan"),
        ('<prompt schema="trip"><plan days="12345"/></prompt>', "is 5 tokens, longer than its parameter (4 tokens)"),
        ('<prompt schema="trip"><plan weeks="1"/></prompt>', "unknown parameter 'weeks' for module 'plan' (its parameters: days)"),
        ('<prompt schema="trip"><tokyo/></prompt>', "import it as <plan><far><tokyo/></far></plan>"),
        ('<prompt schema="trip"><tail/><tail/></prompt>', "imported twice"),
        ('<prompt schema="trip"><plan><tail/></plan></prompt>', "cannot be imported inside <plan>"),
    ],
)
def test_plan_errors(prompt, message):
    with pytest.raises(PromptCacheError) as info:
        plan(prompt)
    assert message in str(info.value)
    assert info.value.line == 1 and info.value.column is not None


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ('<schema name="s"><module name="a">x</module><module name="a">y</module></schema>', "duplicate module name 'a'"),
        ('<schema name="s"><module name="a"><param name="p" len="2"/><param name="p" len="2"/></module></schema>', "duplicate parameter 'p'"),
        ('<schema name="s"><param name="p" len="2"/></schema>', "parameter 'p' outside a module"),
    ],
)
def test_schema_errors(source, message):
    with pytest.raises(PromptCacheError, match=message):
        layout(source)
