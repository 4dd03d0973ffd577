"""The drop-in text index: finds stored module texts in a prompt without scanning the store."""

from pc_rag.dropin import KEY_CHARS, ModuleTextIndex

A = "Alpha paragraph: " + "a" * 40
B = "Bravo paragraph: " + "b" * 40


def test_finds_texts_left_to_right_with_exact_offsets():
    index = ModuleTextIndex()
    index.add("docs", "a", A)
    index.add("docs", "b", B)
    prompt = f"intro {B} middle {A} end"
    matches = index.find(prompt)
    assert [(m.name, prompt[m.start : m.end]) for m in matches] == [("b", B), ("a", A)]


def test_partial_text_is_not_a_match_and_short_texts_are_not_indexed():
    index = ModuleTextIndex()
    index.add("docs", "a", A)
    assert index.find("intro " + A[:-1] + " end") == []
    assert not index.add("docs", "short", "x" * (KEY_CHARS - 1)) and len(index) == 1


def test_shared_beginning_prefers_the_longest_verbatim_text():
    index = ModuleTextIndex()
    longer = A + " and more words after it"
    index.add("docs", "a", A)
    index.add("docs", "long", longer)
    assert [m.name for m in index.find("x " + longer)] == ["long"]
    assert [m.name for m in index.find("x " + A + " but different")] == ["a"]


def test_overlapping_occurrences_do_not_both_match_and_schema_filter_applies():
    index = ModuleTextIndex()
    index.add("docs", "a", A)
    index.add("other", "b", B)
    assert [m.name for m in index.find(A + A)] == ["a", "a"]
    assert [m.name for m in index.find(A + B, schemas=["other"])] == ["b"]
    index.remove_schema("docs")
    assert [m.name for m in index.find(A + B)] == ["b"]
