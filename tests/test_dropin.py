"""The drop-in text index: finds stored module texts in a prompt without scanning the store."""

from pc_rag.prompt.dropin import KEY_CHARS, ModuleTextIndex

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


def test_adding_a_module_rebuilds_only_the_small_recent_level():
    """Adding to an automaton means building it again: a large base level stays as it is while a
    few modules are added (each add + search costs a small build, not one of the whole index)."""
    index = ModuleTextIndex()
    for i in range(600):
        index.add("docs", f"d{i}", f"Paragraph number {i:04d} of the archive. " + "x" * 40)
    base = index.snapshot().automata[0]
    assert len(index.snapshot().automata) == 1  # past the merge threshold: everything in one base level
    index.add("docs", "new", "A paragraph added while the index is served, with enough text.")
    snapshot = index.snapshot()
    assert snapshot.automata[0] is base and len(snapshot.automata) == 2
    text = "before " + "Paragraph number 0007 of the archive. " + "x" * 40 + " and " + "A paragraph added while the index is served, with enough text."
    assert [m.name for m in snapshot.find(text)] == ["d7", "new"]


def test_a_snapshot_does_not_change_when_the_index_does():
    index = ModuleTextIndex()
    index.add("docs", "a", A)
    before = index.snapshot()
    index.add("docs", "b", B)
    assert [m.name for m in before.find(A + B)] == ["a"]
    assert [m.name for m in index.find(A + B)] == ["a", "b"]
