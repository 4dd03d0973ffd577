"""Documents encoded between requests (``add_documents(background=True)``), ids as module names,
documents edited under their id, and a document placed twice."""

from __future__ import annotations

import pytest

from pc_rag import PromptCacheError, build_prompt
from pc_rag.prompt.documents import DocumentRecord, default_name, document_id, module_name


def test_ids_become_module_names_and_back():
    for doc_id in ("doc-1", "1", "3f2a0c4e-uuid", "id.x", "idx.y", "has space/and:colons", "ünïcode", "user"):
        name = module_name(doc_id, "text")
        assert document_id(name) == doc_id
        assert build_prompt("q", [name])  # a valid module name
    assert module_name("doc-1", "t") == "doc-1" and module_name("1", "t") == "id.1"
    assert module_name(None, "some text") == module_name("", "some text") == default_name("some text")
    with pytest.raises(PromptCacheError, match="must be a str"):
        module_name(7, "t")


def test_documents_are_encoded_while_a_request_runs_and_it_goes_on(make_engine):
    # a service that is never idle still warms its cache: the document takes turns with the request's steps
    engine = make_engine("llama")
    engine.background.grace_s = 0.0  # ready at once (else: after the next request, or grace_s)
    engine.add_documents(["Seed document so the collection exists."], progress=False)
    engine.stop_token_ids.clear()  # the request runs to the end of the context window unless closed
    stream = engine.stream(build_prompt("Which?", []), max_new_tokens=100_000)
    next(stream)  # the request is being served now
    names = engine.add_documents(["A document queued while a request is served."], background=True)
    steps = 0
    for _ in stream:  # nobody waits for the document: it is encoded within the request's own steps
        steps += 1
        if not engine.background.pending:
            break
    assert engine.background.pending == 0 and names[0] in engine.schemas["docs"].documents
    assert engine.scheduler.running == 1 and next(stream)  # the request goes on
    assert engine.forward.turns.background_s > 0  # its passes ran while the request was served
    stream.close()
    assert engine.plan(build_prompt("Which?", names)).cached_tokens > 0


def test_a_queued_document_deleted_leaves_the_queue_at_once(make_engine):
    engine = make_engine("llama")
    engine.background.grace_s = 3600.0  # nothing starts on its own
    engine.add_documents(["Seed."], ids=["seed"], progress=False)
    engine.add_documents(["Queued, then deleted."], ids=["gone"], background=True)
    engine.add_documents(["Queued and kept."], ids=["kept"], background=True)
    assert {n: s.status for n, s in engine.background.statuses("docs").items()} == {"gone": "queued", "kept": "queued"}
    assert engine.background.text("docs", "gone") == "Queued, then deleted."
    assert engine.delete_documents("gone") == ["gone"]  # a queued document counts as held
    assert engine.background.queued("docs") == ["kept"] and engine.background.text("docs", "gone") is None
    assert engine.wait_for_documents(timeout=120)
    assert set(engine.schemas["docs"].documents) == {"seed", "kept"}  # never added back
    assert engine.delete_documents(["gone", "kept"]) == ["kept"]


def test_a_document_deleted_while_it_is_encoded_is_deleted_as_that_ends(make_engine):
    engine = make_engine("llama")
    engine.add_documents(["Seed."], ids=["seed"], progress=False)
    encoder = engine.background
    add = encoder._add  # noqa: SLF001 - the engine's own add, with a DELETE arriving in the middle of it

    def add_while_deleted(records, **kwargs):
        assert {n: s.status for n, s in encoder.statuses("docs").items()} == {"doc": "in_progress"}
        assert engine.delete_documents("doc") == ["doc"]  # what a DELETE does: answered now
        assert encoder.statuses("docs") == {}  # no longer listed
        return add(records, **kwargs)

    encoder._add = add_while_deleted  # noqa: SLF001
    engine.add_documents(["Encoded, then deleted."], ids=["doc"], background=True)
    assert engine.wait_for_documents(timeout=120)
    assert set(engine.schemas["docs"].documents) == {"seed"} and encoder.encoded == 1


def test_a_document_a_request_waits_for_goes_first(make_engine):
    engine = make_engine("llama")
    engine.background.grace_s = 3600.0
    engine.add_documents([f"Document number {i}." for i in range(3)], ids=["a", "b", "c"], background=True)
    engine.background.prioritise("docs", ["c", "b"])
    assert [job.name for job in engine.background._queue] == ["c", "b", "a"]  # noqa: SLF001
    assert [job.urgent for job in engine.background._queue] == [True, True, False]  # noqa: SLF001
    done = []
    engine.background.add_listener(lambda: done.append(sorted(engine.schemas["docs"].documents)))
    assert engine.wait_for_documents(timeout=120)
    assert done[:2] == [["c"], ["b", "c"]]


def test_a_request_finishing_starts_the_queue(make_engine):
    engine = make_engine("llama")
    engine.background.grace_s = 3600.0
    (name,) = engine.add_documents(["Encoded after the next answer."], background=True)
    engine.generate("an unrelated request", max_new_tokens=2)
    # the worker may start now without being asked: join() waits for it (asks nothing new)
    assert engine.wait_for_documents(timeout=120) and name in engine.schemas["docs"].documents


def test_a_document_that_cannot_be_encoded_is_logged_listed_failed_and_not_retried(make_engine, caplog):
    engine = make_engine("llama")
    engine.add_schema('<schema name="pml"><module name="a">A module.</module></schema>')
    (name,) = engine.add_documents(["Cannot go into a PML schema."], schema="pml", background=True)
    assert engine.wait_for_documents(timeout=120)
    assert "not encoded in the background" in caplog.text
    failed = engine.background.statuses("pml")[name]
    assert (failed.status, failed.code) == ("failed", "invalid_file") and "PML schema" in failed.last_error
    assert engine.background.submit("pml", None, [DocumentRecord("doc-x", "Cannot go into a PML schema.")]) == 1  # other name: queued
    engine.wait_for_documents(timeout=120)
    again = [DocumentRecord(default_name("Cannot go into a PML schema."), "Cannot go into a PML schema.")]
    assert engine.background.submit("pml", None, again) == 0  # refused before: not queued again
    assert engine.background.remove("pml", [name]) == [name] and name not in engine.background.statuses("pml")  # deleted: forgotten


def test_an_edited_document_replaces_its_module_and_kv(make_engine):
    engine = make_engine("llama")
    engine.add_documents(["The first text of the policy."], ids=["policy"], progress=False)
    old_key = engine.schemas["docs"].keys["policy"]
    with pytest.raises(PromptCacheError, match="already holds a different text"):
        engine.add_documents(["The second text of the policy."], ids=["policy"], progress=False)
    engine.add_documents(["The second text of the policy."], ids=["policy"], progress=False, replace_changed=True)
    held = engine.schemas["docs"]
    assert held.documents["policy"].text == "The second text of the policy." and held.keys["policy"] != old_key
    assert old_key not in engine.store
    plan = engine.plan(build_prompt("What does it say?", ["policy"]))
    assert plan.cached_tokens >= len(engine.tokenize("The second text of the policy."))


def test_a_document_placed_twice_is_read_twice_as_full_prefill_reads_it(make_engine):
    engine = make_engine("llama")
    names = engine.add_documents(["Alpha document text here.", "Beta document text here."], progress=False)
    once = engine.plan(build_prompt("Which?", names))
    twice = engine.plan(build_prompt("Which?", [names[0], names[1], names[0]]))  # a retriever's duplicate
    tokens = len(engine.schemas["docs"].layout.modules[names[0]].token_ids)
    assert len(twice.input_ids) == len(once.input_ids) + tokens
    # (the separator after the last document is computed with the question, whichever document that is)
    assert twice.cached_tokens >= once.cached_tokens + tokens - 1 and twice.modules == once.modules
    cached = engine.generate(build_prompt("Which?", [names[0], names[1], names[0]]), max_new_tokens=4)
    full = engine.generate(build_prompt("Which?", [names[0], names[1], names[0]]), max_new_tokens=4, use_cache=False)
    assert cached.stats.cached_tokens == twice.cached_tokens and len(full.token_ids) == 4
    # a PML schema's module still has one place
    engine.add_schema('<schema name="s"><module name="m">Some module text.</module></schema>')
    with pytest.raises(PromptCacheError, match="imported twice"):
        engine.plan(__import__("pc_rag").PML('<prompt schema="s"><m/><m/></prompt>'))


def test_close_drops_the_queue_and_ends_the_worker(make_engine):
    # what runs at interpreter exit: no forward pass left on a daemon thread during teardown
    engine = make_engine("llama")
    engine.background.grace_s = 3600.0
    engine.add_documents(["Queued and never encoded."], background=True)
    engine.background.close(timeout=60)
    assert engine.background.pending == 0 and not engine.background._worker.is_alive()  # noqa: SLF001
    with pytest.raises(PromptCacheError, match="closed"):
        engine.add_documents(["Too late."], background=True)
