"""The batcher's request router (Serve 2.60's RequestRouter API): each generation goes to
the replica holding the longest prefix of its prompt; the policy is deployments/routing.py.

Serve pickles this module by value into every process that holds a handle to the batcher,
so it keeps no state of its own at module level: everything lives in routing.py.

Configured per deployment with `request_router_config` (`serve run` and KubeRay alike):
    request_router_class: deployments.router:PrefixCacheRouter
    request_router_kwargs: {imbalance_margin: 8}
"""

from __future__ import annotations

import logging

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from deployments import routing
from deployments.protocol import GenerateInput, OpenChannel

logger = logging.getLogger("ray.serve")

ROUTER_PATH = "deployments.router:PrefixCacheRouter"


class PrefixCacheRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """No FIFOMixin: a decision is made for one request's prompt, so it must go to that
    request, not to whichever request has waited longest."""

    def initialize_state(self, **kwargs):
        self.index = routing.PrefixIndex(**kwargs)
        self.decisions = {"prefix": 0, "balance": 0, "fallback": 0, "adapter": 0}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        target = _channel_target(pending_request)
        if target is not None:  # an output channel goes to the replica it was asked for
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen:
                return [chosen]
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas, pending_request)
        request = _generate_input(pending_request)
        if request is None or len(candidate_replicas) < 2:
            return fallback
        by_id = {r.replica_id: r for r in candidate_replicas}
        try:
            decision, best_id = self.index.decide(
                request.prompt_token_ids, {i: r.routing_stats for i, r in by_id.items()},
                {i: self.replica_queue_len_cache.get(i) for i in by_id},
                request.params.adapter, request.params.prefix_namespace)
        except Exception:  # a malformed report must never stop routing
            logger.exception("prefix routing failed; using Serve's choice")
            decision, best_id = "fallback", None
        self._count(decision)
        if best_id is None:
            return fallback
        self._remember(best_id, request)
        # The holder (or, to balance, the least busy other; with no prefix known, the
        # least busy) first; if its queue is full, Serve's pair.
        return [[by_id[best_id]]] + [[r for r in rank if r.replica_id != best_id]
                                     for rank in fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        """Serve's callback once a replica accepted a request (where Serve runs the
        rejection protocol): remember where the prefix went, whatever chose it."""
        request = _generate_input(pending_request)
        if request is not None:
            self._remember(replica_id, request)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None):
        """Give the chosen replica to the request it was chosen for. Serve matches by
        internal request id, which every call made while serving one HTTP request shares
        (n > 1 and best_of make several), and indexes only the first: the others would
        never be given a replica. Matched by identity instead."""
        pending = self._get_pending_request_matching_internal_request_id(request_metadata)
        if pending is None or pending.metadata is not request_metadata:
            pending = next((p for p in self._pending_requests_to_fulfill
                            if p.metadata is request_metadata and not p.future.done()), None)
        if pending is None:
            return
        self._cancel_routing_task_for_pending_request(pending)
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        self._remove_pending_request_from_indices(pending)
        self.index.chosen(replica.replica_id)

    def on_send_request(self, replica_id: ReplicaID):
        super().on_send_request(replica_id)
        self.index.sent(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)

    def _remember(self, replica_id: ReplicaID, request: GenerateInput) -> None:
        replica = self._replicas.get(replica_id)
        stats = self.index.fresh(replica.routing_stats) if replica is not None else None
        if stats is not None:
            self.index.remember(replica_id, request.prompt_token_ids, stats["block_size"],
                                request.params.prefix_namespace)

    def _count(self, decision: str) -> None:
        self.decisions[decision] += 1
        routing.record_decision(decision)


def _channel_target(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg.replica_id if isinstance(arg, OpenChannel) else None


def _generate_input(pending_request: PendingRequest | None) -> GenerateInput | None:
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, GenerateInput) else None
