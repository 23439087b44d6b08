"""Routing generations to the batcher replica that already holds their prompt's prefix.

Serve's default router picks the less busy of two random replicas, so a conversation's
next turn lands on a replica without its cached prefix about half the time with two
replicas and pays the prefill again. Here each batcher replica reports, through Serve's
`record_routing_stats` hook, the names of the KV blocks it holds (the block manager's
hash chain, truncated to 32 bits) and its load; the router (deployments/router.py, run
by Serve in the ingress process beside the handle) computes the same chain from the
request's token ids and sends the request to the replica holding the longest prefix,
unless that replica is busier than the least busy one by more than `imbalance_margin`
requests, or lacks the free KV blocks for the rest of the prompt: then the least busy
other replica. With no known prefix it is the least busy replica (ties at random), and
Serve's power-of-two choice when some replica's load is unknown.
A wrong guess costs a prefill, never a wrong answer: the replica looks the prefix up in
its own cache.

Between two stats reports (`request_routing_stats_period_s`) the index also remembers
where the router sent each prefix, for `recent_ttl_s`, so a conversation's next turn
follows the first even before the replica has reported the blocks. It also counts the
requests it has given a replica that Serve has not sent yet: Serve adds a request to its
load only once sent, and routes a burst of requests in one pass before sending any, so
without that count every request of a burst would see the same loads (and Serve's own
power-of-two choice, which does not see it, would split a burst of new prompts at random)."""

from __future__ import annotations

import array
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from deployments.metrics import ROUTER, Metrics
from deployments.metrics_hub import collect
from engine.block_manager import prefix_block_hashes

STATS_VERSION = 1
_MASK = 0xFFFFFFFF
_MAX_RECENT = 200_000  # remembered block names per replica
_IN_TRANSIT_TTL_S = 5.0  # a request chosen but never sent (its caller gone) counts this long

# The routers of this process (an ingress replica's handles): to Ray and GET /metrics.
_metrics: Metrics | None = None


def _router_metrics() -> Metrics:
    global _metrics
    if _metrics is None:
        _metrics = Metrics(ROUTER)
    return _metrics


def record_decision(decision: str) -> None:
    _router_metrics().inc("raygen_router_decisions", tags={"decision": decision})


def router_families():
    return collect(_router_metrics().registry)


def pack_hashes(hashes) -> bytes:
    """32-bit truncated block names: 4 bytes a block. A collision (about n / 2**32 a
    lookup) only misroutes."""
    return array.array("I", [h & _MASK for h in hashes]).tobytes()


def unpack_hashes(data: bytes) -> frozenset[int]:
    values = array.array("I")
    values.frombytes(data)
    return frozenset(values)


def chain(token_ids: list[int], block_size: int, namespace: str | None = None) -> list[int]:
    """The block names a replica gives the prompt's blocks (under its prefix namespace:
    SamplingParams.prefix_namespace)."""
    return [h & _MASK for h in prefix_block_hashes(token_ids, block_size, namespace)]


@dataclass(slots=True)
class _Holding:
    stamp: float  # the report's time, on the replica's clock
    blocks: frozenset[int]


class PrefixIndex:
    """What each replica holds (its reports, plus where this router sent prefixes since)
    and the routing decision. Keyed by any hashable replica id; no Serve types, so the
    unit tests drive it directly."""

    def __init__(self, imbalance_margin: int = 8, stats_max_age_s: float = 30.0,
                 recent_ttl_s: float = 30.0, min_match_blocks: int = 1):
        self.imbalance_margin = imbalance_margin
        self.stats_max_age_s = stats_max_age_s
        self.recent_ttl_s = recent_ttl_s
        self.min_match_blocks = min_match_blocks
        self._holdings: dict = {}
        self._recent: dict[object, OrderedDict[int, float]] = {}
        self._in_transit: dict[object, deque[float]] = {}

    def fresh(self, stats: dict | None) -> dict | None:
        """The report if it is one of ours and recent enough, else None."""
        if (not stats or stats.get("v") != STATS_VERSION
                or time.time() - stats.get("time", 0.0) > self.stats_max_age_s):
            return None
        return stats

    def matched_blocks(self, replica, stats: dict, names: list[int]) -> int:
        held = self._holdings.get(replica)
        if held is None or held.stamp != stats["time"]:
            held = self._holdings[replica] = _Holding(stats["time"], unpack_hashes(stats["blocks"]))
        recent = self._recent.get(replica, {})
        now = time.monotonic()
        n = 0
        for h in names:
            if h not in held.blocks and now - recent.get(h, -1e18) > self.recent_ttl_s:
                break
            n += 1
        return n

    def decide(self, token_ids: list[int], stats: dict, loads: dict,
               adapter: str | None = None, namespace: str | None = None
               ) -> tuple[str, object]:
        """stats: replica -> its report (None if missing); loads: replica -> requests it
        is serving (None: use its report). Returns ('prefix', holder), ('balance', the
        least busy other replica) or, with no prefix known, ('fallback', the least busy
        replica, or None where a load is unknown: Serve's own choice). A request of a LoRA
        `adapter` that only some replicas hold looks among those alone ('adapter' where
        no prefix is known), unless they are busier than the margin. `namespace` names the
        blocks (SamplingParams.prefix_namespace; the adapter's where not given)."""
        fresh = {r: s for r, s in ((r, self.fresh(s)) for r, s in stats.items()) if s}
        holders = self._adapter_holders(adapter, fresh, loads)
        if holders is not None:  # only they are candidates, as for a prefix
            stats, fresh = {r: stats[r] for r in holders}, holders
        if not fresh or len(token_ids) < 2:
            decision = "adapter" if holders is not None else "fallback"
            return decision, self._least_busy(stats, fresh, loads)
        block_size = next(iter(fresh.values()))["block_size"]
        names = chain(token_ids, block_size, adapter if namespace is None else namespace)
        matched = {r: self.matched_blocks(r, s, names) for r, s in fresh.items()}
        load = {r: (loads.get(r) if loads.get(r) is not None else s["running"] + s["waiting"])
                + self.in_transit(r) for r, s in fresh.items()}
        best = max(fresh, key=lambda r: (matched[r], -load[r]))
        if matched[best] < self.min_match_blocks:
            decision = "adapter" if holders is not None else "fallback"
            return decision, self._least_busy(stats, fresh, loads)
        uncached_blocks = -(-len(token_ids) // block_size) - matched[best]
        if (load[best] - min(load.values()) > self.imbalance_margin
                or fresh[best]["free_blocks"] < uncached_blocks):
            others = [r for r in fresh if r != best]
            return "balance", min(others, key=lambda r: (load[r], -matched[r]), default=None)
        return "prefix", best

    def _adapter_holders(self, adapter: str | None, fresh: dict, loads: dict) -> dict | None:
        """The replicas that hold a LoRA adapter some others do not (those would load it
        first), while the least busy of them is within the margin of the least busy
        replica; else None: any replica will do."""
        if adapter is None:
            return None
        holders = {r: s for r, s in fresh.items() if adapter in s.get("adapters", ())}
        if not holders or len(holders) == len(fresh):
            return None
        load = {r: (loads.get(r) if loads.get(r) is not None else s["running"] + s["waiting"])
                + self.in_transit(r) for r, s in fresh.items()}
        if min(load[r] for r in holders) - min(load.values()) > self.imbalance_margin:
            return None
        return holders

    def _least_busy(self, replicas, fresh: dict, loads: dict):
        """The replica with the fewest requests (Serve's count, else its report, plus
        those in transit); None if one's load is unknown, such as a replica that has not
        reported yet. Ties at random, so that several routers do not all pick the same."""
        load = {}
        for r in replicas:
            n = loads.get(r)
            if n is None:
                if r not in fresh:
                    return None
                n = fresh[r]["running"] + fresh[r]["waiting"]
            load[r] = n + self.in_transit(r)
        if not load:
            return None
        low = min(load.values())
        return random.choice([r for r, n in load.items() if n == low])

    def remember(self, replica, token_ids: list[int], block_size: int,
                 namespace: str | None = None) -> None:
        recent = self._recent.setdefault(replica, OrderedDict())
        now = time.monotonic()
        for h in chain(token_ids, block_size, namespace):
            recent[h] = now
            recent.move_to_end(h)
        while recent and (now - next(iter(recent.values())) > self.recent_ttl_s
                          or len(recent) > _MAX_RECENT):
            recent.popitem(last=False)

    def chosen(self, replica) -> None:
        """A request was given `replica`; it counts in its load until `sent`."""
        self._in_transit.setdefault(replica, deque()).append(time.monotonic())

    def sent(self, replica) -> None:
        """Serve sent a request to `replica` and now counts it itself."""
        waiting = self._in_transit.get(replica)
        if waiting:
            waiting.popleft()

    def in_transit(self, replica) -> int:
        waiting = self._in_transit.get(replica)
        if not waiting:
            return 0
        now = time.monotonic()
        while waiting and now - waiting[0] > _IN_TRANSIT_TTL_S:
            waiting.popleft()
        return len(waiting)

    def forget(self, replica) -> None:
        self._holdings.pop(replica, None)
        self._recent.pop(replica, None)
        self._in_transit.pop(replica, None)
