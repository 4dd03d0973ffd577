"""The connection to Redis (or Valkey) that the remote tier's parts share: clients with
timeouts, the policy for a failing server (marked down for a while, never failing a request),
rejected values counted and logged, and values signed with the operator's key.

Everything read back from Redis was written by someone else: another replica, another version,
another tenant's process, or an attacker who can reach the server. :meth:`RedisLink.opened` is
where a signed value is checked before anything else reads it.

Authentication: with an operator key (``remote_key=`` or ``PC_RAG_REMOTE_KEY``) every record
and log entry is stored as ``<HMAC-SHA256> <JSON>``, the MAC covering the Redis key it is stored
under, the JSON and, for KV, the whole payload; a value whose MAC does not verify under the
current key or one of the previous keys (rotation) is rejected. Without a key the MAC is ``-``
and only structure, checksums and shapes are checked (CRC is not authentication: anyone who can
write to Redis can then poison the tier; docs/tenants.md says to set a key in production).

Redis down, slow or full never fails a request: every command runs under a timeout of a few
milliseconds (payload transfers, on their own connection, get room for their size too); an
error marks the link down for ``retry_s`` seconds (logged once), during which callers are given
their default at once; afterwards it is tried again. Registry reads run on a connection with
their own, longer timeout, and a command the server refuses there (a key of the wrong type) is a
rejected value, not a server that is down.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .. import forks
from ..errors import PromptCacheError

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "valkey", "valkeys", "unix")
# the slowest transfer rate a healthy Redis is allowed for a payload chunk before it counts as down
BULK_BYTES_PER_S = 100e6
KEY_ENV = "PC_RAG_REMOTE_KEY"
PREVIOUS_KEYS_ENV = "PC_RAG_REMOTE_PREVIOUS_KEYS"  # comma-separated: keys still accepted while rotating
UNSIGNED = "-"


def connect(url: str, *, timeout_ms: float) -> Any:
    """A redis-py client for ``url`` (``redis://``, ``rediss://``, ``valkey://``, ``unix://``), with
    ``timeout_ms`` on connecting and on every command."""
    try:
        import redis
    except ImportError as err:  # pragma: no cover - the "distributed" extra
        raise PromptCacheError('remote_store needs the redis client: pip install "pc-rag[distributed]"') from err
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise PromptCacheError(f"remote_store must be a redis://, rediss://, valkey:// or unix:// URL, got {redact_url(url)!r}")
    # Valkey speaks the Redis protocol: its URL schemes are Redis' under another name
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(parts.scheme, parts.scheme)
    return redis.Redis.from_url(urlunsplit((scheme, *parts[1:])), socket_timeout=timeout_ms / 1000,
                                socket_connect_timeout=timeout_ms / 1000, retry_on_timeout=False)


# ---------------------------------------------------------------------------------------------
# Authentication
# ---------------------------------------------------------------------------------------------
class Signer:
    """HMAC-SHA256 under the operator's key: signs with the current key, accepts the current and
    the previous ones (key rotation). Without keys nothing is signed and everything verifies."""

    def __init__(self, key: str | bytes | None = None, previous: Iterable[str | bytes] = ()) -> None:
        keys = [k for k in [key, *previous] if k]
        self.keys = [k.encode() if isinstance(k, str) else bytes(k) for k in keys]

    @classmethod
    def from_settings(cls, key: str | bytes | Sequence[str | bytes] | None) -> Signer:
        """``remote_key=``: a key, or a list (the first signs, all verify); None reads
        ``PC_RAG_REMOTE_KEY`` and ``PC_RAG_REMOTE_PREVIOUS_KEYS``."""
        if key is None:
            previous = [k.strip() for k in os.environ.get(PREVIOUS_KEYS_ENV, "").split(",") if k.strip()]
            return cls(os.environ.get(KEY_ENV) or None, previous)
        if isinstance(key, (str, bytes)):
            return cls(key)
        keys = list(key)
        if not keys or not all(isinstance(k, (str, bytes)) and k for k in keys):
            raise PromptCacheError("remote_key must be a non-empty str or bytes, or a list of them (the first signs)")
        return cls(keys[0], keys[1:])

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @staticmethod
    def _mac(key: bytes, parts: Sequence[bytes]) -> str:
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "big"))  # unambiguous framing of the parts
            mac.update(part)
        return mac.hexdigest()

    def sign(self, *parts: bytes) -> str:
        return self._mac(self.keys[0], parts) if self.keys else UNSIGNED

    def verify(self, mac: str, *parts: bytes) -> bool:
        if not self.keys:
            return True
        return any(hmac.compare_digest(mac, self._mac(key, parts)) for key in self.keys)


def _canonical(body: dict[str, Any]) -> str:
    # metadata that JSON cannot hold (dates, objects) is kept as its str()
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str)


class RedisLink:
    """Three connections to one Redis (commands, payload chunks, registry pages), the key prefix
    of one engine fingerprint, the signer, and the down/rejected bookkeeping."""

    def __init__(self, url: str, fingerprint: str, prefix: str, *, key: str | bytes | Sequence[str | bytes] | None = None,
                 timeout_ms: float = 50.0, retry_s: float = 2.0, bulk_bytes: int = 64 << 20,
                 registry_timeout_ms: float = 2000.0) -> None:
        self.url = url
        self.fingerprint = fingerprint
        self.prefix = prefix
        self.signer = Signer.from_settings(key)
        self.retry_s = retry_s
        self.client = connect(url, timeout_ms=timeout_ms)
        # payload chunks travel on a second connection with room for their size: the small
        # commands before them (the record, EXISTS) already told a slow or absent Redis apart
        self.bulk = connect(url, timeout_ms=timeout_ms + 1000 * bulk_bytes / BULK_BYTES_PER_S)
        # registry pages: their own, longer timeout (a page of 2,000 records is not a 50 ms command)
        self.registry = connect(url, timeout_ms=registry_timeout_ms)
        self._down_until = 0.0
        self._lock = threading.Lock()
        forks.renew_after_fork(self, "_lock")
        self.errors = 0
        self.rejected = 0  # values read back and refused (malformed, unauthenticated, foreign)
        self._rejections: set[tuple[str, str]] = set()  # what was refused already: a bad record read at every sync is logged once

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def ping(self) -> bool:
        """Whether Redis answers now (a round trip; marks the link down when it does not)."""
        return bool(self.call("ping", lambda: self.client.ping(), False))

    def failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            announce = self.available  # log when the tier goes down, not on every skipped call
            self._down_until = time.monotonic() + self.retry_s
        if announce:
            logger.warning("remote store %s unavailable (%s: %s); serving from local tiers, retrying in %.1f s",
                           redact_url(self.url), what, exc, self.retry_s)

    def call(self, what: str, fn: Any, default: Any, *, refused_is_data: bool = False) -> Any:
        """``fn()`` unless the link is down; a Redis or socket error marks it down and gives
        ``default``. With ``refused_is_data`` (registry reads), a command the server refuses (a
        key of the wrong type, written by someone else) is a rejected value instead: logged, and
        the link stays up."""
        if not self.available:
            return default
        import redis

        try:
            return fn()
        except redis.ResponseError as exc:
            if not refused_is_data:
                self.failed(what, exc)
            else:
                self.reject(what, str(exc), once=True)
            return default
        except (redis.RedisError, OSError) as exc:
            self.failed(what, exc)
            return default

    def reject(self, what: str, problem: str, *, once: bool = False) -> None:
        """Count and log a value that cannot be used; ``once``: a value read again at every sync
        (a collection's record, a key of the wrong type), counted and logged the first time only."""
        with self._lock:
            if once:
                if (what, problem) in self._rejections:
                    return
                if len(self._rejections) < 100_000:
                    self._rejections.add((what, problem))
            self.rejected += 1
        logger.warning("remote store: %s rejected: %s", what, problem)

    def signed(self, redis_key: str, body: dict[str, Any], payload: Iterable[bytes] = ()) -> str:
        """``body`` as stored under ``redis_key``: ``<MAC> <canonical JSON>``, the MAC over the key, the JSON and ``payload``."""
        text = _canonical(body)
        return f"{self.signer.sign(redis_key.encode(), text.encode(), *payload)} {text}"

    def opened(self, redis_key: str, raw: Any, payload: Sequence[bytes] = ()) -> dict[str, Any]:
        """The JSON object of a signed value, or a PromptCacheError saying why it cannot be used."""
        if not isinstance(raw, (bytes, str)):
            raise PromptCacheError(f"not a string value ({type(raw).__name__})")
        text = raw.decode("utf-8", errors="strict") if isinstance(raw, bytes) else raw
        mac, _, body = text.partition(" ")
        try:
            value = json.loads(body)
        except ValueError as err:
            raise PromptCacheError(f"not JSON ({err})") from None
        if not isinstance(value, dict):
            raise PromptCacheError(f"a JSON {type(value).__name__}, not an object")
        if not self.signer.verify(mac, redis_key.encode(), body.encode(), *payload):
            raise PromptCacheError("not authenticated with the operator's key" if mac == UNSIGNED else "MAC does not verify")
        return value


def redact_url(url: str) -> str:
    """``url`` without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit((parts.scheme, netloc, *parts[2:]))
    return url
