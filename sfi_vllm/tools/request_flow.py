"""Which requests of a long offline run to hand to the engine next (``EngineJob.max_open``).

A request may name another one it waits for (``"after": j``): it is handed over only once request
``j`` has finished. The quality suite uses this for prefix caching: every policy's request on a
sample waits for that sample's dense request, so its prompt blocks are in vLLM's prefix cache
(vLLM caches a block once its prefill has been computed; a follower submitted together with its
dense request would race it and compute the prompt again). A request without ``after`` is a
*root*; a root and the requests that wait for it form a *group*.

Compared with phases (all dense prompts of a chunk, then all the other requests of the chunk), a
flow keeps the batch full: a group's followers start as soon as its dense request ends, while other
groups prefill or decode, so there is no per-phase tail of a few long requests running alone.

* At most ``max_open`` groups are open (handed over and not finished) at a time: their prompts stay
  in the prefix cache, and roots are handed over in the order given.
* ``time_limit_s``: a new group is opened only while the projected end (now + the requests of the
  open groups and the new one that are still to finish / the completion rate so far, with a
  margin) stays within the limit; past the limit, :meth:`overdue` says to abort what is still
  running (those groups are left incomplete).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Sequence

DRAIN_MARGIN = 1.25  # the projected drain time is stretched by this factor...
DRAIN_EXTRA_S = 5.0  # ...plus this many seconds (the last requests run in a thinning batch)


class RequestFlow:
    def __init__(self, after: Sequence[int | None], max_open: int, time_limit_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if max_open < 1:
            raise ValueError("max_open must be at least 1")
        self.max_open = max_open
        self.time_limit_s = time_limit_s
        self.clock = clock
        self.t0 = clock()
        self.roots: deque[int] = deque()
        self.followers: dict[int, list[int]] = {}
        self.group_of: dict[int, int] = {}
        self.total = len(after)
        for i, a in enumerate(after):
            if a is None:
                self.roots.append(i)
                self.followers.setdefault(i, [])
        for i, a in enumerate(after):
            if a is None:
                continue
            if a not in self.followers:
                raise ValueError(f"request {i} waits for {a}, which is not a root (one level of waiting only)")
            self.followers[a].append(i)
        for root, fol in self.followers.items():
            self.group_of[root] = root
            for j in fol:
                self.group_of[j] = root
        self.left: dict[int, int] = {}  # open group -> requests of it not finished
        self.handed: set[int] = set()  # handed over, not finished
        self.released: list[int] = []  # followers whose root finished, not yet handed over
        self.finished_count = 0
        self.stopped = False  # no new groups (time limit)
        self.stop_reason: str | None = None

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def projected_drain_s(self, extra: int = 0) -> float | None:
        """Seconds to finish the open groups (and ``extra`` more requests) at the completion rate so
        far, with a margin; None before any request has finished."""
        if not self.finished_count:
            return None
        rate = self.finished_count / max(self.elapsed(), 1e-9)
        return DRAIN_MARGIN * (sum(self.left.values()) + extra) / rate + DRAIN_EXTRA_S

    def next_requests(self) -> list[int]:
        """Requests to hand over now: released followers, then roots of new groups."""
        out, self.released = self.released, []
        while self.roots and len(self.left) < self.max_open and not self.stopped:
            root = self.roots[0]
            size = 1 + len(self.followers[root])
            drain = self.projected_drain_s(size) if self.time_limit_s is not None else None
            if drain is not None and self.elapsed() + drain > self.time_limit_s:
                if not self.left:  # nothing left to wait for: the next group would end past the limit
                    self.stopped = True
                    self.stop_reason = (f"time limit {self.time_limit_s:.0f} s: no new groups after "
                                        f"{self.elapsed():.0f} s (projected {drain:.0f} s for the next one)")
                break  # otherwise wait: the rate so far may still be rising
            self.roots.popleft()
            self.left[root] = size
            out.append(root)
        self.handed.update(out)
        return out

    def finished(self, i: int) -> None:
        self.handed.discard(i)
        self.finished_count += 1
        g = self.group_of[i]
        self.left[g] -= 1
        if not self.left[g]:
            del self.left[g]
        if i == g:
            self.released.extend(self.followers[g])

    def overdue(self) -> bool:
        """Past the time limit: the caller should abort :attr:`handed` and stop."""
        return self.time_limit_s is not None and self.elapsed() > self.time_limit_s

    def done(self) -> bool:
        return not self.left and not self.released and (self.stopped or not self.roots)

    def not_run(self) -> int:
        """Requests that have not finished (never handed over, or aborted)."""
        return self.total - self.finished_count
