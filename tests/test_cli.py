"""The CLI runs every example schema; bad input ends with a clear message and exit code 2."""

from pathlib import Path

import pytest

from pc_rag.cli import demo_schema, main
from pc_rag.pml import parse_schema

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
                 "--prompt", str(EXAMPLES / prompt), "--max-new-tokens", "4", "--compare"])
    out = capsys.readouterr().out
    assert code == 0
    assert "[cached] cached" in out and "[full prefill] cached 0 /" in out and "TTFT speedup" in out


def test_cli_reports_bad_prompts(tiny_folder, capsys):
    code = main(["generate", "--model", str(tiny_folder), "--schema", str(EXAMPLES / "travel.xml"),
                 "--prompt", '<prompt schema="travel"><trip-plan><tokio/></trip-plan></prompt>'])
    assert code == 2
    assert "unknown module <tokio/>" in capsys.readouterr().err


def test_demo_schema_escapes_documentation_text():
    doc = parse_schema(demo_schema())
    assert doc.name == "stdlib-docs" and len(doc.children) == 2
