"""Fair share of prefill positions between tenants (API keys): who gets a step's prefill room first.

A step's prefill room is handed out one prompt chunk at a time. The next chunk goes to the tenant that has been
served the fewest prefill positions (start-time fair queueing over positions); inside a tenant its own order holds
(deadline-first: admitted prompts between chunks, then preempted ones, priority, arrival). A tenant that had nothing
waiting starts level with the least-served tenant that is waiting, not with the credit of its idle time, and a tie
goes to the tenant picked least recently: a newcomer goes before a tenant with a burst queued. So one key's burst of
300 prompts costs another key's new prompt at most one chunk of the burst, not the whole burst.

Sans-I/O: the scheduler asks for an order and charges what it ran; nothing here knows about steps or devices.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class FairShare:
    """Prefill positions served per tenant (only tenants with work waiting are kept), and the interleaving."""

    def __init__(self) -> None:
        self.served: dict[Hashable, int] = {}  # positions served, relative to the least-served waiting tenant
        self.last_pick: dict[Hashable, int] = {}
        self._picks = itertools.count()

    def order(self, queues: Mapping[Hashable, Sequence[T]]) -> FairOrder[T]:
        """(tenant, item) in fair order: each pick takes the next item of the least-served tenant that has one
        left. Charge what each item ran with `charge` before taking the next pick (the order follows it)."""
        return FairOrder(self, queues)

    def charge(self, tenant: Hashable, positions: int) -> None:
        """`tenant` ran `positions` prefill positions."""
        self.served[tenant] = self.served.get(tenant, 0) + positions

    def snapshot(self) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
        """The served positions and the last picks, for `restore`."""
        return dict(self.served), dict(self.last_pick)

    def restore(self, state: tuple[dict[Hashable, int], dict[Hashable, int]]) -> None:
        """Back to a `snapshot`: the picks and charges since are forgotten."""
        self.served, self.last_pick = dict(state[0]), dict(state[1])

    def _level(self, tenants: Iterable[Hashable]) -> None:
        """Forget tenants with nothing waiting; a new one starts level with the least served; all relative to it."""
        waiting = set(tenants)
        for gone in [t for t in self.served if t not in waiting]:
            del self.served[gone]
            self.last_pick.pop(gone, None)
        floor = min(self.served.values(), default=0)
        for tenant in waiting:
            self.served[tenant] = self.served.get(tenant, floor) - floor


class FairOrder(Iterator[tuple[Hashable, T]], Generic[T]):
    """One pass of `FairShare.order` over queues of items; each pick is recorded as it is taken."""

    def __init__(self, fair: FairShare, queues: Mapping[Hashable, Sequence[T]]) -> None:
        self.fair = fair
        self.queues = {t: q for t, q in queues.items() if q}
        fair._level(self.queues.keys())
        self.heads = dict.fromkeys(self.queues, 0)

    def __next__(self) -> tuple[Hashable, T]:
        if not self.heads:
            raise StopIteration
        fair = self.fair
        tenant = min(self.heads, key=lambda t: (fair.served[t], fair.last_pick.get(t, -1)))
        i = self.heads[tenant]
        self.heads[tenant] = i + 1
        if i + 1 >= len(self.queues[tenant]):
            del self.heads[tenant]
        fair.last_pick[tenant] = next(fair._picks)
        return tenant, self.queues[tenant][i]

    def skip_rest(self) -> None:
        """Take every pick left, charging none: the record that iterating to the end leaves, without a pick per
        item. With nothing charged the least-served tenants go round by round until their queues run out, so each
        tenant's last pick falls in the order (served, items left, last pick)."""
        fair = self.fair
        for tenant in sorted(self.heads, key=lambda t: (fair.served[t], len(self.queues[t]) - self.heads[t],
                                                          fair.last_pick.get(t, -1))):
            fair.last_pick[tenant] = next(fair._picks)
        self.heads.clear()
