"""Paths as users write them: ``~`` and environment variables expanded in every path argument."""

from __future__ import annotations

import os
from pathlib import Path


def expand(path: str | os.PathLike) -> Path:
    """``path`` with ``~``/``~user`` and ``$VAR``/``${VAR}`` expanded, as a shell would (so
    ``kv_dir="~/.cache/my-app"`` is under the home folder, not a folder named ``~``)."""
    return Path(os.path.expandvars(os.path.expanduser(os.fspath(path))))


def cache_root() -> Path:
    """pc-rag's per-user cache folder (``$PC_RAG_HOME`` or ``$XDG_CACHE_HOME/pc-rag``)."""
    if os.environ.get("PC_RAG_HOME"):
        return expand(os.environ["PC_RAG_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pc-rag"
