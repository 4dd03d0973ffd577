"""Per-key quotas: how many generations each API key has in flight, against its ``max_in_flight``.

The scheduler's queue (``--max-queued``) is shared by every tenant and served first come, first
served, so without a bound per key one tenant's burst fills it and every other tenant gets 429
until the burst drains. Here a key holds one slot per generation (a text-completion request with
several prompts holds one per prompt) from the moment its request is authenticated (before its
body is read: a slow body holds a slot, so one key cannot tie up connections either) until its
last token is sent or its client goes away; past its bound the key gets 429 at once, while other
keys' requests go on.

A key's ``max_tokens_per_minute`` is checked at the same moment: the tokens its generations used
(prompt and completion, charged as each finishes) within the last minute must be below it, else
429 with ``Retry-After`` saying when enough of them leave the minute. A request is not priced
before it runs (its prompt is not read yet, its reply not written), so the one that crosses the
bound finishes, and the key's next requests wait: the bound holds over any minute but one
request's worth. A request whose client leaves first is charged what it may have used (the
server's ``_charge_departed``), so leaving just before the end does not escape the bound.

Slots and tokens are counted on the event loop's thread only (every handler runs there), so no lock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from ..errors import PromptCacheError
from .tenants import Tenant
from .wire import rate_limited

# told of every change: (tenant, slots it holds now, whether a request was refused)
Listener = Callable[[Tenant, int, bool], None]
WINDOW_S = 60.0  # max_tokens_per_minute's minute


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

    def __init__(self, listener: Listener | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._held: dict[Tenant, int] = {}
        self._spent: dict[Tenant, deque[tuple[float, int]]] = {}  # (when, tokens) of the last minute, oldest first
        self._listener = listener
        self._clock = clock

    def held(self, tenant: Tenant) -> int:
        return self._held.get(tenant, 0)

    def take(self, tenant: Tenant, count: int = 1) -> Slots:
        """``count`` slots for ``tenant``'s request: 429 past its bound or with its tokens of the
        last minute at ``max_tokens_per_minute``, 400 for a request that alone asks for more
        slots than the bound (it could never be served)."""
        self._check_tokens(tenant)
        self._take(tenant, count)
        return Slots(self, tenant, count)

    def spend(self, tenant: Tenant, tokens: int) -> None:
        """``tenant``'s generation finished having used ``tokens`` (prompt and completion)."""
        if tenant.max_tokens_per_minute is not None and tokens > 0:
            self._spent.setdefault(tenant, deque()).append((self._clock(), tokens))

    def spent(self, tenant: Tenant) -> int:
        """The tokens ``tenant``'s generations used within the last minute."""
        return sum(tokens for _, tokens in self._window(tenant))

    def spending(self) -> dict[str, int]:
        """Tokens of the last minute of every key that used any, by the key's name (the metrics)."""
        return {tenant.name: self.spent(tenant) for tenant in list(self._spent) if self.spent(tenant)}

    def _window(self, tenant: Tenant) -> deque[tuple[float, int]]:
        spent = self._spent.get(tenant)
        if spent is None:
            return deque()
        oldest = self._clock() - WINDOW_S
        while spent and spent[0][0] <= oldest:
            spent.popleft()
        if not spent:
            del self._spent[tenant]
        return spent

    def _check_tokens(self, tenant: Tenant) -> None:
        bound = tenant.max_tokens_per_minute
        if bound is None:
            return
        window = self._window(tenant)
        used = sum(tokens for _, tokens in window)
        if used < bound:
            return
        for when, tokens in window:  # the earliest moment the minute holds fewer than the bound
            used -= tokens
            if used < bound:
                break
        wait = max(1, math.ceil(when + WINDOW_S - self._clock()))
        self._tell(tenant, self.held(tenant), refused=True)
        raise rate_limited(f"{tenant.name} used {sum(t for _, t in window)} tokens in the last minute, its bound "
                           f"(max_tokens_per_minute: {bound}); retry in {wait} s", "rate_limit_exceeded", wait)

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
