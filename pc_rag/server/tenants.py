"""API keys: which collections each caller may read and write, how many requests it may have in
flight, and how many tokens it may use per minute.

``--api-keys FILE`` is a JSON object mapping each key to the list of collections it may use, or
to an object with that list and the key's own bounds::

    {"key-of-team-a": ["handbook", "tickets"],
     "key-of-team-b": {"collections": ["contracts"], "max_in_flight": 4, "max_tokens_per_minute": 20000}}

A request presents ``Authorization: Bearer KEY``; it then sees only its key's collections (the
engine's ``collections=`` scope: nothing outside them is imported, matched or named). Keys are
compared in constant time against every key (no early exit that would time a prefix) and never
logged: logs, errors and metrics name a key by its position in the file (``key #2``). Without a
key file the server is single-user: every request sees every collection.

``max_in_flight`` (a key's own, else ``--max-in-flight-per-key``, else no bound) is how many
generations a key may have between arriving and their last token at once
(:mod:`pc_rag.server.quota`): past it the key's requests get 429 while other keys' are served, so
one tenant cannot fill the queue the scheduler shares among all of them. ``max_tokens_per_minute``
(a key's own, else ``--max-tokens-per-minute-per-key``) bounds the tokens (prompt and completion,
as OpenAI counts them) its generations used in the last minute: past it, its requests get 429
until enough of the minute has passed.
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


@dataclass(frozen=True, eq=False)  # identity, not value: two keys with the same rights are two tenants
class Tenant:
    """One caller's rights: ``collections`` it may read and write (None: all, single-user),
    ``max_in_flight`` generations at once and ``max_tokens_per_minute`` (None: no bound of its
    own), and ``name``, what logs, errors and metrics call it (never the key)."""

    collections: frozenset[str] | None
    max_in_flight: int | None = None
    name: str = "single-user"
    max_tokens_per_minute: int | None = None

    def may_use(self, collection: str) -> bool:
        return self.collections is None or collection in self.collections

    @property
    def scope(self) -> list[str] | None:
        """The collections this caller's requests may read (None: all)."""
        return None if self.collections is None else sorted(self.collections)

    @property
    def generation_scope(self) -> list[str] | None:
        """The engine's ``collections=`` argument for this caller's generations: its collections and
        a name no collection can have (``<key #2>``), so that the passages the engine learns from its
        prompts (``--learn-passages``, :mod:`pc_rag.prompt.recurring`) are this key's alone, even
        where another key has the same collections."""
        return None if self.collections is None else [*self.scope, f"<{self.name}>"]


SINGLE_USER = Tenant(None)


class Tenants:
    """Keys and the collections each may use (see the module docstring)."""

    def __init__(self, keys: Mapping[str, Any], *, max_in_flight: int | None = None, max_tokens_per_minute: int | None = None) -> None:
        """``keys``: the key file's object; ``max_in_flight`` and ``max_tokens_per_minute``: the
        bounds of every key that sets none of its own."""
        if not isinstance(keys, Mapping) or not keys:
            raise PromptCacheError("the API key file must be a non-empty JSON object: {\"KEY\": [\"collection\", ...], ...}")
        defaults = {"max_in_flight": _bound(max_in_flight, "max_in_flight_per_key"),
                    "max_tokens_per_minute": _bound(max_tokens_per_minute, "max_tokens_per_minute_per_key")}
        self._keys: list[tuple[bytes, Tenant]] = []
        for index, (key, value) in enumerate(keys.items()):
            # the key itself never appears in a message: entries are named by their position
            name = f"key #{index + 1}"
            if not isinstance(key, str) or len(key) < 8 or key.strip() != key:
                raise PromptCacheError(f"{name} of the API key file: a key is a string of at least 8 characters, no surrounding spaces")
            collections, bounds = _entry(value, name, defaults)
            self._keys.append((_digest(key), Tenant(collections, name=name, **bounds)))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, max_in_flight: int | None = None,
                  max_tokens_per_minute: int | None = None) -> "Tenants":
        try:
            with open(path, encoding="utf-8") as handle:
                keys = json.load(handle)
        except (OSError, json.JSONDecodeError) as exc:
            raise PromptCacheError(f"cannot read the API key file {os.fspath(path)!r}: {exc}") from None
        return cls(keys, max_in_flight=max_in_flight, max_tokens_per_minute=max_tokens_per_minute)

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


def _entry(value: Any, name: str, defaults: dict[str, int | None]) -> tuple[frozenset[str], dict[str, int | None]]:
    """A key's collections and bounds (its own, else ``defaults``), from its value in the key file."""
    bounds = dict(defaults)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"collections", *defaults})
        if unknown or "collections" not in value:
            raise PromptCacheError(f"{name} of the API key file: an object value takes \"collections\" (required), "
                                   "\"max_in_flight\" and \"max_tokens_per_minute\"" + (f", not {unknown}" if unknown else ""))
        for bound in defaults:
            if bound in value:
                bounds[bound] = _bound(value[bound], f"{name} of the API key file: {bound}")
        value = value["collections"]
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise PromptCacheError(f"{name} of the API key file: its collections must be a list of collection names")
    return frozenset(check_name(c, "collection name") for c in value), bounds


def _bound(value: Any, what: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise PromptCacheError(f"{what} must be an integer >= 1 (or null: no bound), got {value!r}")
    return value


def _digest(key: str) -> bytes:
    """Fixed-length digests, so comparison time does not depend on the key's length."""
    return hashlib.sha256(key.encode()).digest()
