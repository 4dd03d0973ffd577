"""The CLI runs every example schema; bad input ends with a clear message and exit code 2."""

import json
import re
from pathlib import Path

import pytest

from pc_rag.cli import main
from pc_rag.corpus import stdlib_corpus
from pc_rag.demo import DEMO_QUESTIONS

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
    assert out.count("Q: ") == len(DEMO_QUESTIONS) and out.count("| speedup ") == len(DEMO_QUESTIONS)
    agreements = re.findall(r"against full prefill: first token (agrees|differs), (\d+) of (\d+) leading tokens equal", out)
    assert len(agreements) == len(DEMO_QUESTIONS) and all(int(n) <= int(of) for _, n, of in agreements)
    firsts = sum(a == "agrees" for a, _, _ in agreements)
    assert f"totals: first token agrees on {firsts} of {len(DEMO_QUESTIONS)} questions; " \
           f"{sum(int(n) for _, n, _ in agreements)} of {sum(int(of) for _, _, of in agreements)} leading tokens" in out
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
    common = ["--model", str(tiny_folder), "--remote-store", redis_server.url]
    assert main(["encode", str(folder), *common]) == 0
    assert "encoded 3 documents" in capsys.readouterr().out
    # a fresh process-like engine: ask serves those documents, with its own empty kv_dir
    assert main(["ask", "When did the mill stop?", *common, "--max-new-tokens", "3", "--kv-dir", str(tmp_path / "kv"), "-k", "1"]) == 0
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


# -- what a new user hit, following the README literally -------------------------------------------
def test_help_is_fast_because_it_loads_no_model_code():
    import subprocess
    import sys

    # a fresh interpreter: --help must not import torch (7 s of imports before this was fixed)
    probe = "import sys; from pc_rag.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "False"
    encode_help = build_parser_help("encode")
    assert "--max-new-tokens" not in encode_help and "--remote-store" in encode_help  # each command: its own options


def build_parser_help(command: str) -> str:
    from pc_rag.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices[command].format_help()  # noqa: SLF001


def test_a_missing_schema_file_is_named_before_any_model_loads(capsys):
    # the model does not exist either: the file check comes first, so it is the error reported
    code = main(["generate", "--model", "./no-such-model", "--schema", "examples/nope.xml", "--prompt", "hi"])
    assert code == 2 and "schema file 'examples/nope.xml' not found" in capsys.readouterr().err
    code = main(["generate", "--model", "./no-such-model", "--prompt", "questions/q1.txt"])
    assert code == 2 and "prompt file 'questions/q1.txt' not found" in capsys.readouterr().err


def test_a_pml_prompt_without_pml_says_it_is_read_as_text(tiny_folder, capsys):
    code = main(["generate", "--model", str(tiny_folder), "--schema", str(EXAMPLES / "travel.xml"),
                 "--prompt", str(EXAMPLES / "travel_prompt.xml"), "--max-new-tokens", "2"])
    assert code == 0 and "read as plain text; pass --pml" in capsys.readouterr().err


def test_examples_readme_passes_pml():
    commands = [line for line in (EXAMPLES / "README.md").read_text().splitlines() if "pc-rag generate" in line]
    assert commands and all("--pml" in line for line in commands)


def test_a_model_that_does_not_exist_is_one_line_at_once(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # CI has no hub either: the answer must not depend on a network
    assert main(["generate", "--model", "./models/missing", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == "pc-rag: error: model folder 'models/missing' does not exist"
    assert main(["generate", "--model", "no-such-org/no-such-model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'no-such-org/no-such-model' is not a local folder, not in the hub cache" in err


def test_paths_expand_the_home_folder(tiny_folder, tmp_path, monkeypatch, make_engine):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PC_RAG_TEST_DIR", "expanded")
    engine = make_engine("llama", kv_dir="~/cache/$PC_RAG_TEST_DIR")
    assert engine.kv_dir == tmp_path / "cache" / "expanded"
    engine.add_documents(["A document stored under the home folder."], progress=False)
    assert any((tmp_path / "cache" / "expanded").rglob("*.safetensors")) and not Path("~").exists()
    import shutil

    shutil.copytree(tiny_folder, tmp_path / "tiny")
    from pc_rag.model.loading import load_model

    model, _ = load_model("~/tiny")  # a model folder under ~ too
    assert model.config.model_type == "llama"


def test_ask_labels_the_answer_once():
    from pc_rag.demo import answer_text

    assert answer_text(" A: The json module.") == "The json module." and answer_text("Answer: yes") == "yes"
    assert answer_text("Use json.dumps.") == "Use json.dumps."
