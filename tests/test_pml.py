"""PML parsing: the paper's syntax, escaping, and errors that say what and where."""

import pytest

from pc_rag import PromptCacheError, escape, parse_prompt, parse_schema
from pc_rag.prompt.pml import ModuleNode, ModuleRef, ParamNode, PromptRole, RoleNode, UnionNode, is_pml_prompt

APPENDIX_TRAVEL = """<schema name="travel">
<system>
You are a world-renowned travel planner ...
</system>
<user>
<module name="travel-plan"> I'm gearing up for a memorable escape ...
<parameter name="duration" length="5" />
<union>
<module name=domestic> My eyes are set ...
<parameter name="city" length="10" />
Given its domestic charm ...
</module>
<module name="overseas"> I'm yearning to tread ...
<union>
<module name="maldives">The Maldives beckons ...</module>
<module name="tokyo">Tokyo, Japan's bustling,...</module>
</union>
</module>
</union>
</module>
</user>
<assistant>
I'd love to help.
</assistant>
</schema>"""


def test_appendix_schema_parses_with_unquoted_attributes_and_parameter_spelling():
    doc = parse_schema(APPENDIX_TRAVEL)
    assert doc.name == "travel"
    system, user, assistant = doc.children
    assert isinstance(system, RoleNode) and system.role == "system"
    assert system.children[0].text == "You are a world-renowned travel planner ..."
    (plan,) = user.children
    assert isinstance(plan, ModuleNode) and plan.name == "travel-plan"
    param = plan.children[1]
    assert isinstance(param, ParamNode) and (param.name, param.length) == ("duration", 5)
    union = plan.children[2]
    assert isinstance(union, UnionNode) and [m.name for m in union.members] == ["domestic", "overseas"]
    nested = union.members[1].children[1]
    assert isinstance(nested, UnionNode) and [m.name for m in nested.members] == ["maldives", "tokyo"]
    assert assistant.children[0].text == "I'd love to help."


def test_role_text_is_stripped_but_module_text_is_verbatim():
    doc = parse_schema('<schema name="s"><user>\n  Hi  \n</user><module name="m">\n  code\n</module></schema>')
    assert doc.children[0].children[0].text == "Hi"
    assert doc.children[1].children[0].text == "\n  code\n"


def test_param_short_spelling():
    doc = parse_schema('<schema name="s"><module name="m">a <param name="x" len="3"/> b</module></schema>')
    assert doc.children[0].children[1] == ParamNode("x", 3, 1, 37)


def test_escapes_and_cdata_carry_source_code():
    code = "if a < b && c > d:\n    return '<x>'"
    doc = parse_schema(f'<schema name="s"><module name="a.py"><![CDATA[{code}]]></module>'
                       f'<module name="b.py">{escape(code)}</module></schema>')
    assert doc.children[0].children[0].text == code
    assert doc.children[1].children[0].text == code
    assert parse_schema('<schema name="s"><module name="m">&#60;&#x3E;&quot;&apos;</module></schema>').children[0].children[0].text == "<>\"'"


def test_prompt_with_nested_refs_args_roles_and_text():
    doc = parse_prompt('<prompt schema="travel"><travel-plan duration="3 days"><overseas><tokyo/></overseas></travel-plan>'
                       '<user>Highlight the surf spots</user></prompt>')
    assert doc.schema == "travel"
    ref, role = doc.children
    assert isinstance(ref, ModuleRef) and ref.args == {"duration": "3 days"}
    assert ref.children[0].name == "overseas" and ref.children[0].children[0].name == "tokyo"
    assert isinstance(role, PromptRole) and role.children[0].text == "Highlight the surf spots"


def test_is_pml_prompt():
    assert is_pml_prompt('  <prompt schema="x"><a/></prompt>')
    assert is_pml_prompt('<?xml version="1.0"?>\n<prompt schema="x"/>')
    assert not is_pml_prompt("What is a <prompt>?")
    assert not is_pml_prompt("<prompts>")


@pytest.mark.parametrize(
    ("source", "message", "line", "column"),
    [
        ('<schema name="s">\n<module name="m">x</modul></schema>', "</modul> closes <module>", 2, 19),
        ('<schema name="s"><module name="m">x</module>', "<schema> is never closed", 1, 1),
        ('<schema name="s"><module name="m">&bomb;</module></schema>', "unknown entity '&bomb;'", 1, 35),
        ('<!DOCTYPE x [<!ENTITY a "aaa">]><schema name="s"/>', "DTDs", 1, 1),
        ('<schema name="s"><modul name="m">x</modul></schema>', "unknown tag <modul>", 1, 18),
        ('<schema name="s"><module>x</module></schema>', "needs a 'name' attribute", 1, 18),
        ('<schema name="s"><module name="m"><param name="p" len="0"/></module></schema>', "positive integer length", 1, 35),
        ('<schema name="s"><union>text<module name="m">x</module></union></schema>', "text directly inside <union>", 1, 25),
        ('<schema name="s"/><schema name="t"/>', "second root element", 1, 19),
        ('', "empty PML document", 1, 1),
        ('<schema name="s"><module name="m" name="n">x</module></schema>', "duplicate attribute 'name'", 1, 34),
        ('<prompt schema="s"><a>text</a></prompt>', "text inside the reference <a>", 1, 23),
        ('<schema name="s">' + "<module name='m'>" * 70, "nested deeper than 64", 1, 1089),
    ],
)
def test_syntax_errors_say_what_and_where(source, message, line, column):
    parse = parse_prompt if source.startswith("<prompt") else parse_schema
    with pytest.raises(PromptCacheError) as info:
        parse(source)
    assert message in str(info.value)
    assert (info.value.line, info.value.column) == (line, column)
    assert isinstance(info.value, ValueError)


def test_a_bare_ampersand_and_a_lt_that_starts_no_tag_are_text():
    # as the reference implementation's own demo and benchmark schemas write them (it damages
    # them: its parser drops the text); an entity-shaped '&name;' and '<name' stay markup
    schema = parse_schema('<schema name="s"><module name="m">AT&T && R&D: a < b, x <= 3, <3 &amp; &lt;</module></schema>')
    (module,) = schema.children
    assert module.children[0].text == "AT&T && R&D: a < b, x <= 3, <3 & <"
    assert parse_prompt('<prompt schema="s"><m/>Is a < b & c?</prompt>').children[-1].text == "Is a < b & c?"
    with pytest.raises(PromptCacheError, match="unknown entity '&T;'"):
        parse_schema('<schema name="s"><module name="m">AT&T;</module></schema>')
    with pytest.raises(PromptCacheError, match="malformed tag <b"):
        parse_schema('<schema name="s"><module name="m">a <b and c</module></schema>')


def test_wrong_root_elements():
    with pytest.raises(PromptCacheError, match="expected <schema>"):
        parse_schema('<prompt schema="s"/>')
    with pytest.raises(PromptCacheError, match="expected <prompt>"):
        parse_prompt('<schema name="s"/>')
    with pytest.raises(PromptCacheError, match="needs a 'schema' attribute"):
        parse_prompt("<prompt><a/></prompt>")


def test_positions_stay_exact_in_a_large_schema():
    """Lines and columns come from one table of line starts (parsing was quadratic: a 200 KB
    schema took 9.7 s); every element of a 20,000-line schema still knows where it is."""
    body = "".join(f'<module name="m{i}">Line {i} &amp; more.\n</module>\n' for i in range(10_000))
    doc = parse_schema(f'<schema name="big">\n{body}</schema>')
    modules = [c for c in doc.children if isinstance(c, ModuleNode)]
    assert len(modules) == 10_000
    assert (modules[0].line, modules[0].column) == (2, 1) and (modules[-1].line, modules[-1].column) == (20_000, 1)
    assert modules[-1].children[0].text == "Line 9999 & more.\n"
    with pytest.raises(PromptCacheError) as info:
        parse_schema(f'<schema name="big">\n{body}   <oops a=b c></schema>')
    assert (info.value.line, info.value.column) == (20_002, 13) and "malformed tag <oops>" in str(info.value)
