"""Reference-affinity routing of `klein serve --replicas N`: a Ray Serve request router (its public
`RequestRouter` API) that keeps each reference set on one replica.

The set's id travels as the request's `multiplexed_model_id` (the front sets it). A set seen before goes
to its home replica first; a new set (or one whose home has died) is homed on the replica with the
fewest sets, ties broken at random, so that sets spread over the replicas; requests without references
go to two replicas picked at random, as Serve's default router does. The answer is ranked: the home
first, then the others by their number of sets, so that when the home is full (`max_ongoing_requests`)
Serve's router sends the request to the next rank, where the set is encoded too, rather than waiting.

Homes are decided here, when the request is routed, so a set's second request finds it at once; Serve's
model multiplexing, tried first, learns which replica holds a set from the replica's own report (every
0.1 s, through the controller), and a request that came sooner went elsewhere and encoded the set again
(docs/design.md, "Replicas"). The router lives in the front, the one caller of the replicas, so its
table sees every request.
"""

from __future__ import annotations

import collections
import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

MAX_HOMES = 4096
"""Sets remembered (least recently routed out): a forgotten set is homed again, like a new one."""


class ReferenceRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._homes: collections.OrderedDict[str, ReplicaID] = collections.OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if not key:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        sets = collections.Counter(self._homes.values())
        ranked = sorted(candidate_replicas, key=lambda r: (sets[r.replica_id], random.random()))
        home = self._home(key, ranked)
        return [[home], [replica for replica in ranked if replica is not home]]

    def _home(self, key: str, ranked: list[RunningReplica]) -> RunningReplica:
        """The set's home among the live replicas; a new or homeless set gets the one with the fewest."""
        live = {replica.replica_id: replica for replica in ranked}
        home = live.get(self._homes.get(key), ranked[0])
        self._homes[key] = home.replica_id
        self._homes.move_to_end(key)
        while len(self._homes) > MAX_HOMES:
            self._homes.popitem(last=False)
        return home
