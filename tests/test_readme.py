"""README code blocks marked ``<!-- readme-test: ... -->`` run as written (on the embedded models)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = dict(re.findall(r"<!-- readme-test: ([\w-]+) -->\n```python\n(.*?)```", README.read_text(), flags=re.S))


def test_the_marked_blocks_exist():
    assert set(BLOCKS) == {"langchain", "llama-index"}


@pytest.mark.parametrize("name", ["langchain", "llama-index"])
def test_readme_block_runs_as_written(name, capsys):
    namespace: dict = {}
    exec(compile(BLOCKS[name], f"README.md[{name}]", "exec"), namespace)  # noqa: S102 - our own README
    printed = capsys.readouterr().out
    if name == "langchain":
        message = namespace["message"]
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0
        assert sorted(message.response_metadata["modules"]) == ["sb50-venue", "sb50-winner"]
        assert printed.startswith(str(message.usage_metadata["input_token_details"]["cache_read"]))
    else:
        assert printed.strip()  # an answer (a 135M model's)
