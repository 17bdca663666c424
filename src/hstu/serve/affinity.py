"""Which idle model process runs a batch, when each process keeps its own user-prefix cache.

With ``--prefix-cache-mb`` and several model processes (:class:`hstu.serve.worker.ProcessModel`),
a user's cached prefix lives in the process that ran the user's last request. When more than one
process is idle as a batch is dispatched, :class:`UserAffinity` picks the one that last ran most
of the batch's users, so a returning user finds its prefix and each user is cached once instead of
once per process. Under load only one process is idle at a time (the scheduler takes the first
that frees, vLLM-style) and there is nothing to choose: batches go where there is room, as
without the cache.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable

AFFINITY_USERS = 100_000  # users whose last model process is remembered (least recently seen forgotten first)


class UserAffinity:
    """The model process each user id last ran on, for at most ``capacity`` users.

    Args:
        capacity: users remembered (>= 1); beyond it the least recently dispatched is forgotten
            (its next batch goes wherever there is room, as a new user's).
    """

    def __init__(self, capacity: int = AFFINITY_USERS) -> None:
        if capacity < 1:
            raise ValueError(f"UserAffinity capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._last: OrderedDict[Hashable, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def where(self, user: Hashable) -> int | None:
        """The process ``user`` last ran on, or None."""
        return self._last.get(user)

    def choose(self, idle: list[int], users: Iterable[Hashable]) -> int:
        """Of the ``idle`` process indices (non-empty, in the order they became idle), the one that
        last ran most of ``users`` (the batch's user ids, None for a request without one); ties,
        and a batch of users never seen, go to the first idle. Records the choice for each user."""
        users = [u for u in users if u is not None]
        votes = Counter(self._last.get(u) for u in users)
        best = max(idle, key=lambda p: votes[p])  # max keeps the first of equals
        for u in users:
            self._last[u] = best
            self._last.move_to_end(u)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
        return best


__all__ = ["AFFINITY_USERS", "UserAffinity"]
