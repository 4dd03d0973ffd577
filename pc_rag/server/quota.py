"""Per-key quotas: how many generations each API key has in flight, against its ``max_in_flight``.

The scheduler's queue (``--max-queued``) is shared by every tenant and served first come, first
served, so without a bound per key one tenant's burst fills it and every other tenant gets 429
until the burst drains. Here a key holds one slot per generation (a text-completion request with
several prompts holds one per prompt) from the moment its request is authenticated (before its
body is read: a slow body holds a slot, so one key cannot tie up connections either) until its
last token is sent or its client goes away; past its bound the key gets 429 at once, while other
keys' requests go on.

A key's ``max_tokens_per_minute`` is checked at the same moment (its tokens of the last minute,
with those its requests in flight hold, must be below it), and again once the body is read: the
request then holds what it may use (:meth:`Slots.reserve`: the tokens of its rendered prompts, of
the documents they import and each generation's ``max_tokens``, as OpenAI prices a request against
its rate limit), refused with 429 when that would take the key past its bound, with
``Retry-After`` saying when enough of the minute's tokens leave it (400 when the request alone asks
for more than the bound: it could never be served). As each request finishes it is charged what it
used (``usage``'s total tokens) and lets go of what it held, so a key's
tokens stay within its bound over any minute. A request whose client leaves first is charged what
it may have used (the server's ``_charge_departed``), so leaving just before the end does not
escape the bound.

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
        self.tokens = 0  # of the key's minute, held until the request is charged what it used

    def reserve(self, tokens: int) -> None:
        """Hold ``tokens`` of the key's ``max_tokens_per_minute`` (what the request may use) until
        :meth:`release`: 429 when they do not fit the key's minute now, 400 when they never could."""
        self._quota._reserve(self.tenant, tokens)
        self.tokens += tokens

    def grow(self, total: int) -> None:
        """Hold ``total`` slots instead (a request whose body asks for several generations)."""
        if total > self.count:
            self._quota._take(self.tenant, total - self.count, asked=total)
            self.count = total

    def charge(self, tokens: int) -> None:
        """The request used ``tokens`` (prompt and completion) of the key's minute: charged, and
        what it held let go of at the same moment (a request of the key checked between the two
        would count them twice)."""
        self._quota.spend(self.tenant, tokens)
        if self.tokens:
            self._quota._give_back(self.tenant, 0, self.tokens)
            self.tokens = 0

    def hand_over(self) -> "Slots":
        """The same slots, held on by whoever takes them (a streamed response, until it ends);
        this object's :meth:`release` then gives back nothing."""
        taken = Slots(self._quota, self.tenant, self.count)
        taken.tokens, self.count, self.tokens = self.tokens, 0, 0
        return taken

    def release(self) -> None:
        if self.count or self.tokens:
            self._quota._give_back(self.tenant, self.count, self.tokens)
            self.count = self.tokens = 0


class Quota:
    """Slots in use per tenant (see the module docstring); ``listener`` is told of every change
    (the server's metrics)."""

    def __init__(self, listener: Listener | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._held: dict[Tenant, int] = {}
        self._spent: dict[Tenant, deque[tuple[float, int]]] = {}  # (when, tokens) of the last minute, oldest first
        self._reserved: dict[Tenant, int] = {}  # tokens the requests in flight may still use (Slots.reserve)
        self._listener = listener
        self._clock = clock

    def held(self, tenant: Tenant) -> int:
        return self._held.get(tenant, 0)

    def take(self, tenant: Tenant, count: int = 1) -> Slots:
        """``count`` slots for ``tenant``'s request: 429 past its bound or with its tokens of the
        last minute (and those its requests in flight hold) at ``max_tokens_per_minute``, 400 for a
        request that alone asks for more slots than the bound (it could never be served)."""
        self._check_tokens(tenant)
        self._take(tenant, count)
        return Slots(self, tenant, count)

    def spend(self, tenant: Tenant, tokens: int) -> None:
        """``tenant``'s generation finished having used ``tokens`` (prompt and completion)."""
        if tenant.max_tokens_per_minute is not None and tokens > 0:
            self._spent.setdefault(tenant, deque()).append((self._clock(), tokens))

    def reserved(self, tenant: Tenant) -> int:
        """The tokens ``tenant``'s requests in flight hold (what they may still use)."""
        return self._reserved.get(tenant, 0)

    def spent(self, tenant: Tenant) -> int:
        """The tokens ``tenant``'s generations used within the last minute."""
        return sum(tokens for _, tokens in self._window(tenant))

    def holding(self) -> dict[str, int]:
        """Tokens the requests in flight of every key that holds any hold, by the key's name (the metrics)."""
        return {tenant.name: tokens for tenant, tokens in self._reserved.items()}

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

    def _check_tokens(self, tenant: Tenant, tokens: int = 0) -> None:
        """Room in ``tenant``'s minute for ``tokens`` more (for at least one more, by default)."""
        bound = tenant.max_tokens_per_minute
        if bound is None:
            return
        need, held = max(tokens, 1), self.reserved(tenant)
        window = self._window(tenant)
        used = sum(spent for _, spent in window)
        if used + held + need <= bound:
            return
        self._tell(tenant, self.held(tenant), refused=True)
        said = (f"{tenant.name} used {used} tokens in the last minute" + (f" and holds {held} for its requests in flight" if held else "")
                + (f"; this request may use {tokens}" if tokens else "") + f", past its bound (max_tokens_per_minute: {bound})")
        if held + need > bound:  # the minute's spent tokens leaving is not enough: its requests in flight must end
            raise rate_limited(f"{said}; retry when a request has finished", "rate_limit_exceeded")
        left = used
        for when, spent in window:  # the earliest moment the minute has room
            left -= spent
            if left + held + need <= bound:
                break
        wait = max(1, math.ceil(when + WINDOW_S - self._clock()))
        raise rate_limited(f"{said}; retry in {wait} s", "rate_limit_exceeded", wait)

    def _reserve(self, tenant: Tenant, tokens: int) -> None:
        bound = tenant.max_tokens_per_minute
        if bound is None or tokens <= 0:
            return
        if tokens > bound:
            self._tell(tenant, self.held(tenant), refused=True)
            raise PromptCacheError(f"this request may use {tokens} tokens (its prompts, the documents they import and max_tokens "
                                   f"for each generation); {tenant.name} may use at most {bound} a minute (max_tokens_per_minute)")
        self._check_tokens(tenant, tokens)
        self._reserved[tenant] = self.reserved(tenant) + tokens

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

    def _give_back(self, tenant: Tenant, count: int, tokens: int = 0) -> None:
        if tokens:
            reserved = self.reserved(tenant) - tokens
            if reserved > 0:
                self._reserved[tenant] = reserved
            else:
                self._reserved.pop(tenant, None)
        left = max(self.held(tenant) - count, 0)
        if left:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)
        self._tell(tenant, left, refused=False)

    def _tell(self, tenant: Tenant, held: int, *, refused: bool) -> None:
        if self._listener is not None:
            self._listener(tenant, held, refused)
