"""The repository stands alone: a user's clone has nothing beside it, so nothing reads outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a path climbing out of the repository to a folder beside it: "../shared", parents[1].parent / "shared", ...
OUTSIDE = re.compile(r"\.\./shared|parents\[\d\]\.parent|ROOT\.parent|\"shared/data|'shared/data")


def test_no_source_reads_a_folder_beside_the_repository():
    offenders = []
    for folder in ("pc_rag", "tests", "benchmarks", "notebooks", "examples"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in {".py", ".ipynb", ".md", ".xml"} and path != Path(__file__).resolve():
                for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if OUTSIDE.search(line):
                        offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_data_file_is_described_beside_it():
    for folder in (ROOT / "tests" / "data", ROOT / "benchmarks" / "data"):
        described = (folder / "README.md").read_text()
        files = [p.name for p in folder.iterdir() if p.name != "README.md"]
        assert files, folder
        for name in files:
            assert f"`{name}`" in described, f"{folder.relative_to(ROOT)}/{name} has no source and licence in its README"
        assert "licence" in described.lower()
