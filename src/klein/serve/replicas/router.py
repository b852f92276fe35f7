"""Affinity routing of `klein serve --replicas N`: a Ray Serve request router (its public `RequestRouter`
API) that keeps each reference set on one replica and sends LoRAs where they sit in slots already.

The request's key (`affinity.routing_key`: set id and LoRA names) travels as its `multiplexed_model_id`
(the front sets it); the decision is `affinity.ranks`. Its answer is ranked: the best first, then the
others, so that when the best is full (`max_ongoing_requests`) Serve's router sends the request to the
next rank, where the set is encoded too, rather than waiting.

Homes are decided here, when the request is routed, so a set's second request finds it at once; Serve's
model multiplexing, tried first, learns which replica holds a set from the replica's own report (every
0.1 s, through the controller), and a request that came sooner went elsewhere and encoded the set again
(docs/design.md, "Replicas"). A request's LoRAs are counted as held where Serve says the request was
accepted (`on_request_routed`). The router lives in the front, the one caller of the replicas, so its
tables see every request.
"""

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
