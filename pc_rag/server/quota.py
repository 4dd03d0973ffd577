"""Per-key quotas: how many generations each API key has in flight, against its ``max_in_flight``.

The scheduler's queue (``--max-queued``) is shared by every tenant and served first come, first
served, so without a bound per key one tenant's burst fills it and every other tenant gets 429
until the burst drains. Here a key holds one slot per generation (a text-completion request with
several prompts holds one per prompt) from the moment its request is authenticated (before its
body is read: a slow body holds a slot, so one key cannot tie up connections either) until its
last token is sent or its client goes away; past its bound the key gets 429 at once, while other
keys' requests go on.

Slots are counted on the event loop's thread only (every handler runs there), so no lock.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import PromptCacheError
from .tenants import Tenant
from .wire import rate_limited

# told of every change: (tenant, slots it holds now, whether a request was refused)
Listener = Callable[[Tenant, int, bool], None]


class Slots:
    """What one request holds; :meth:`release` gives it back (once, however often it is called)."""

    def __init__(self, quota: "Quota", tenant: Tenant, count: int) -> None:
        self._quota, self.tenant, self.count = quota, tenant, count

    def grow(self, total: int) -> None:
        """Hold ``total`` slots instead (a request whose body asks for several generations)."""
        if total > self.count:
            self._quota._take(self.tenant, total - self.count, asked=total)
            self.count = total

    def hand_over(self) -> "Slots":
        """The same slots, held on by whoever takes them (a streamed response, until it ends);
        this object's :meth:`release` then gives back nothing."""
        taken = Slots(self._quota, self.tenant, self.count)
        self.count = 0
        return taken

    def release(self) -> None:
        if self.count:
            self._quota._give_back(self.tenant, self.count)
            self.count = 0


class Quota:
    """Slots in use per tenant (see the module docstring); ``listener`` is told of every change
    (the server's metrics)."""

    def __init__(self, listener: Listener | None = None) -> None:
        self._held: dict[Tenant, int] = {}
        self._listener = listener

    def held(self, tenant: Tenant) -> int:
        return self._held.get(tenant, 0)

    def take(self, tenant: Tenant, count: int = 1) -> Slots:
        """``count`` slots for ``tenant``'s request: 429 past its bound, 400 for a request that
        alone asks for more than the bound (it could never be served)."""
        self._take(tenant, count)
        return Slots(self, tenant, count)

    def _take(self, tenant: Tenant, count: int, *, asked: int | None = None) -> None:
        """``count`` more slots for a request that holds ``asked`` in all (default: ``count``)."""
        bound, held, asked = tenant.max_in_flight, self.held(tenant), asked or count
        if bound is not None and held + count > bound:
            self._tell(tenant, held, refused=True)
            if asked > bound:
                raise PromptCacheError(f"this request asks for {asked} generations at once; {tenant.name} may have "
                                       f"at most {bound} in flight (max_in_flight)")
            raise rate_limited(f"{tenant.name} has {held} requests in flight, its bound (max_in_flight: {bound}); "
                               "retry when one has finished", "rate_limit_exceeded")
        self._held[tenant] = held + count
        self._tell(tenant, held + count, refused=False)

    def _give_back(self, tenant: Tenant, count: int) -> None:
        left = max(self.held(tenant) - count, 0)
        if left:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)
        self._tell(tenant, left, refused=False)

    def _tell(self, tenant: Tenant, held: int, *, refused: bool) -> None:
        if self._listener is not None:
            self._listener(tenant, held, refused)
