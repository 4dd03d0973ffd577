"""API keys: which collections each caller may read and write.

``--api-keys FILE`` is a JSON object mapping each key to the list of collections it may use::

    {"key-of-team-a": ["handbook", "tickets"], "key-of-team-b": ["contracts"]}

A request presents ``Authorization: Bearer KEY``; it then sees only its key's collections (the
engine's ``collections=`` scope: nothing outside them is imported, matched or named). Keys are
compared in constant time against every key (no early exit that would time a prefix) and never
logged. Without a key file the server is single-user: every request sees every collection.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PromptCacheError
from ..prompt.documents import check_name
from .wire import ApiError


@dataclass(frozen=True)
class Tenant:
    """One caller's rights: ``collections`` it may read and write (None: all, single-user)."""

    collections: frozenset[str] | None

    def may_use(self, collection: str) -> bool:
        return self.collections is None or collection in self.collections

    @property
    def scope(self) -> list[str] | None:
        """The engine's ``collections=`` argument for this caller's requests."""
        return None if self.collections is None else sorted(self.collections)


SINGLE_USER = Tenant(None)


class Tenants:
    """Keys and the collections each may use (see the module docstring)."""

    def __init__(self, keys: Mapping[str, Any]) -> None:
        if not isinstance(keys, Mapping) or not keys:
            raise PromptCacheError("the API key file must be a non-empty JSON object: {\"KEY\": [\"collection\", ...], ...}")
        self._keys: list[tuple[bytes, Tenant]] = []
        for index, (key, collections) in enumerate(keys.items()):
            # the key itself never appears in a message: entries are named by their position
            if not isinstance(key, str) or len(key) < 8 or key.strip() != key:
                raise PromptCacheError(f"API key #{index + 1}: a key is a string of at least 8 characters, no surrounding spaces")
            if not isinstance(collections, list) or not all(isinstance(c, str) for c in collections):
                raise PromptCacheError(f"API key #{index + 1}: its value must be a list of collection names")
            names = frozenset(check_name(c, "collection name") for c in collections)
            self._keys.append((_digest(key), Tenant(names)))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "Tenants":
        try:
            with open(path, encoding="utf-8") as handle:
                keys = json.load(handle)
        except (OSError, json.JSONDecodeError) as exc:
            raise PromptCacheError(f"cannot read the API key file {os.fspath(path)!r}: {exc}") from None
        return cls(keys)

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant whose key ``Authorization: Bearer KEY`` presents; 401 otherwise."""
        scheme, _, key = (authorization or "").partition(" ")
        given = _digest(key.strip()) if scheme.lower() == "bearer" else b""
        found: Tenant | None = None
        for digest, tenant in self._keys:  # every key compared, whichever matches
            if hmac.compare_digest(digest, given) and found is None:
                found = tenant
        if found is None:
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)", kind="authentication_error",
                           code="invalid_api_key")
        return found


def _digest(key: str) -> bytes:
    """Fixed-length digests, so comparison time does not depend on the key's length."""
    return hashlib.sha256(key.encode()).digest()
