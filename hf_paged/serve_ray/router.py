"""`PrefixAffinityRouter`: Ray Serve's request router for the engine replicas.

A request carries its prompt's block hashes (``prefix=`` keyword, computed by the ingress). It goes to the replica
that was last sent the longest prefix of them, when that prefix is more than half the prompt and that replica has at
most ``max_imbalance`` requests in flight from this router beyond the least busy one's (`affinity_replica`);
otherwise to the less loaded of two random replicas. A call with a ``replica=`` keyword goes to that replica only
(the ingress reads each replica's metrics that way). A replica is sent at most ``max_ongoing_requests`` calls by
this router (the ingress holds back the calls beyond that many per replica, `ingress.ModelCallGate`); a call marked
``control=True`` (a health probe, a listing: the deployment keeps `CONTROL_SLOTS` more for them) may go to any
replica, so that it is answered however busy the replicas are.

The router lives in the ingress's process; `registry.router_of(app_name)` finds it there, for its statistics.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import registry
from .affinity import AffinityTable, affinity_replica


@dataclass
class RoutingStats:
    """What the router did with the requests that carried a prompt."""

    requests: int = 0
    affinity_requests: int = 0  # sent to a replica that was sent at least the prompt's first block
    prompt_blocks: int = 0
    matched_blocks: int = 0  # of those, blocks the chosen replica was sent before: the predicted prefix hits


# Calls each replica takes beyond max_ongoing_requests, kept for control calls.
CONTROL_SLOTS = 16


class PrefixAffinityRouter(RequestRouter):
    """Prefix-cache affinity with power-of-two-choices fallback (see the module docstring)."""

    def initialize_state(self, max_imbalance: int = 8, table_capacity: int = 1 << 17,
                         max_ongoing_requests: int | None = None):
        self.max_imbalance = max_imbalance
        self.max_ongoing_requests = max_ongoing_requests
        self.table = AffinityTable(table_capacity)
        self.stats = RoutingStats()
        self.in_flight: Counter[ReplicaID] = Counter()
        # Calls routed and not completed, by Serve's request id (the calls made while serving one HTTP request share
        # it: the ingress's calls for /metrics or an adapter update, one per replica).
        self._routed: dict[str, Counter[ReplicaID]] = {}
        registry.ROUTERS[self.app_name] = self

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = {}
        if pending_request is not None:
            kwargs = pending_request.kwargs
            pending_request.routing_context.should_backoff = True  # when no choice is taken, wait before the next
        target = kwargs.get("replica")
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        if not kwargs.get("control") and self.max_ongoing_requests is not None:
            candidate_replicas = [r for r in candidate_replicas
                                  if self.in_flight[r.replica_id] < self.max_ongoing_requests]
            if not candidate_replicas:  # every one is full: the call waits (backing off) in this router
                return []
        balanced = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        by_id = {r.replica_id: r for r in candidate_replicas}
        in_flight = {replica: self.in_flight[replica] for replica in by_id}
        best = affinity_replica(self.table, kwargs.get("prefix") or (), in_flight, self.max_imbalance)
        return [balanced] if best is None else [[by_id[best]], balanced]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.in_flight[replica_id] += 1
        self._routed.setdefault(pending_request.metadata.internal_request_id, Counter())[replica_id] += 1
        hashes = pending_request.kwargs.get("prefix")
        if hashes is None:
            return
        matched = self.table.matched(hashes, replica_id)
        self.stats.requests += 1
        self.stats.affinity_requests += matched > 0
        self.stats.prompt_blocks += len(hashes)
        self.stats.matched_blocks += matched
        self.table.record(hashes, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._routed.get(internal_request_id)
        if routed and routed[replica_id] > 0:
            routed[replica_id] -= 1
            self.in_flight[replica_id] -= 1
            if not +routed:
                del self._routed[internal_request_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [r for r in self.in_flight if r not in live]:
            self._forget(gone)

    def _forget(self, replica_id: ReplicaID) -> None:
        self.table.forget(replica_id)
        self.in_flight.pop(replica_id, None)
