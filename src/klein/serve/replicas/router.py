"""Affinity routing of `klein serve --replicas N`: a Ray Serve `RequestRouter` over `affinity.ranks`, keyed
by the request's `multiplexed_model_id` (`affinity.routing_key`)."""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from klein.serve.replicas.affinity import Holdings, Homes, parse, ranks


class ReferenceRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._homes, self._holdings, self._rng = Homes(), Holdings(), random.Random()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request else ""
        live = {replica.replica_id: replica for replica in candidate_replicas}
        self._holdings.keep_only(live)
        chosen = ranks(list(live), key, self._homes, self._holdings, self._rng)
        return [[live[replica_id] for replica_id in rank] for rank in chosen]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        _, names = parse(pending_request.metadata.multiplexed_model_id)
        if names:
            self._holdings.sent(replica_id, names)
