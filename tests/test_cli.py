"""The CLI runs every example schema; bad input ends with a clear message and exit code 2."""

import json
from pathlib import Path

import pytest

from pc_rag.cli import DEMO_QUESTIONS, main
from pc_rag.corpus import stdlib_corpus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PAIRS = [("travel.xml", "travel_prompt.xml"), ("code_assistant.xml", "code_prompt.xml"), ("personalization.xml", "personalization_prompt.xml")]


@pytest.fixture(scope="module")
def tiny_folder(make_tiny, tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("schema", "prompt"), PAIRS)
def test_examples_run_with_the_cli(tiny_folder, capsys, schema, prompt):
    code = main(["generate", "--model", str(tiny_folder), "--schema", str(EXAMPLES / schema),
                 "--prompt", str(EXAMPLES / prompt), "--pml", "--max-new-tokens", "4", "--compare"])
    out = capsys.readouterr().out
    assert code == 0
    assert "[cached] cached" in out and "[full prefill] cached 0 /" in out and "TTFT speedup" in out


def test_cli_reports_bad_prompts(tiny_folder, capsys):
    code = main(["generate", "--model", str(tiny_folder), "--schema", str(EXAMPLES / "travel.xml"),
                 "--prompt", '<prompt schema="travel"><trip-plan><tokio/></trip-plan></prompt>', "--pml"])
    assert code == 2
    assert "unknown module <tokio/>" in capsys.readouterr().err


def test_corpus_is_real_documentation_in_bounded_passages():
    corpus = stdlib_corpus()
    assert len(corpus) > 30 and len({p.id for p in corpus}) == len(corpus)
    assert all(len(p.text) <= 1000 + len("Python module statistics: ") for p in corpus)
    assert any("JSON" in p.text for p in corpus if p.metadata["python_module"] == "json")


def test_demo_and_ask_run_the_langchain_rag_chain(tiny_folder, tmp_path, capsys):
    args = ["--model", str(tiny_folder), "--kv-dir", str(tmp_path), "--max-new-tokens", "3", "-k", "2"]
    assert main(["demo", *args]) == 0
    out = capsys.readouterr().out
    assert out.count("Q: ") == len(DEMO_QUESTIONS) and out.count("speedup") == len(DEMO_QUESTIONS)
    assert "corpus: " in out and "modules: " in out
    assert any((tmp_path / "kv").rglob("*.safetensors")) and (tmp_path / "index" / "docs" / "index.faiss").is_file()
    stored = sorted(p.name for p in (tmp_path / "kv").rglob("*.safetensors"))
    assert main(["ask", "How do I parse JSON?", *args]) == 0
    out = capsys.readouterr().out
    assert "Q: How do I parse JSON?" in out and "cached" in out and "speedup" not in out
    assert sorted(p.name for p in (tmp_path / "kv").rglob("*.safetensors")) == stored  # nothing re-encoded


def test_encode_then_ask_serves_from_the_remote_store(tiny_folder, tmp_path, redis_server, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "bells.txt").write_text("The cathedral bell was cast in 1822 and rings every hour.")
    (folder / "more.jsonl").write_text(
        json.dumps({"id": "mill", "text": "The old mill ground wheat until the flood of 1910."}) + "\n\n"
        + json.dumps({"text": "Lighthouse keepers logged the weather at dawn.", "metadata": {"lang": "en"}}) + "\n")
    common = ["--model", str(tiny_folder), "--remote-store", redis_server.url, "--max-new-tokens", "3"]
    assert main(["encode", str(folder), *common]) == 0
    assert "encoded 3 documents" in capsys.readouterr().out
    # a fresh process-like engine: ask serves those documents, with its own empty kv_dir
    assert main(["ask", "When did the mill stop?", *common, "--kv-dir", str(tmp_path / "kv"), "-k", "1"]) == 0
    out = capsys.readouterr().out
    assert "corpus: 3 documents from redis://" in out and "modules: mill" in out
    assert not any((tmp_path / "kv").rglob("*.safetensors"))  # nothing encoded here


def test_encode_refuses_bad_input(tiny_folder, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    assert main(["encode", str(bad), "--model", str(tiny_folder)]) == 2
    assert "needs --remote-store" in capsys.readouterr().err
    assert main(["encode", str(bad), "--model", str(tiny_folder), "--remote-store", "redis://127.0.0.1:1/0"]) == 2
    assert "bad.jsonl:1: needs a string field 'text'" in capsys.readouterr().err
