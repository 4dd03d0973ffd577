"""Property-based fuzzing of the PML parser: for any input, nothing but PromptCacheError escapes."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pc_rag import PromptCacheError
from pc_rag.prompt.markup import parse_markup
from pc_rag.prompt.pml import parse_prompt, parse_schema

# fragments that steer random text towards almost-valid markup, where parser bugs live
FRAGMENTS = st.sampled_from([
    "<", ">", "/", "</", "/>", "=", '"', "'", "&", ";", "&lt;", "&#", "&#x", "&amp;", "<![CDATA[", "]]>", "<!--", "-->",
    "<!DOCTYPE x [<!ENTITY a 'b'>]>", "<?xml version='1.0'?>", "<schema name=s>", "</schema>", '<prompt schema="s">',
    "</prompt>", "<module name=m>", "</module>", "<union>", "</union>", '<param name=p len=3/>', "<parameter name=p length=x/>",
    "<system>", "</system>", "<user>", "</user>", "<assistant>", "<m/>", '<m p="v"/>', " ", "\n", "text", "é", "\x00",
])  # fmt: skip
MARKUP = st.lists(st.one_of(FRAGMENTS, st.text(max_size=8)), max_size=40).map("".join)
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _only_typed_errors(parse, source: str) -> None:
    try:
        parse(source)
    except PromptCacheError as err:
        assert str(err)  # every error says what went wrong


@SETTINGS
@given(MARKUP)
def test_schema_parser_raises_only_prompt_cache_errors(source):
    _only_typed_errors(parse_schema, source)


@SETTINGS
@given(MARKUP)
def test_prompt_parser_raises_only_prompt_cache_errors(source):
    _only_typed_errors(parse_prompt, source)


@SETTINGS
@given(st.text(max_size=200))
def test_markup_parser_on_arbitrary_unicode(source):
    _only_typed_errors(parse_markup, source)


def test_deep_nesting_is_a_clear_error_not_a_recursion_error():
    deep = "<schema name=s>" + "<module name=m%d>" * 5000 % tuple(range(5000)) + "</schema>"
    try:
        parse_schema(deep)
    except PromptCacheError as err:
        assert "deep" in str(err) or "nest" in str(err)
    else:  # pragma: no cover - an unclosed 5000-deep document must not parse
        raise AssertionError("parsed an unclosed, 5000-deep schema")
