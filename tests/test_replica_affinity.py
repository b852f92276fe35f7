"""The routing decision of `klein serve --replicas N` (`klein.serve.replicas.affinity`), without Ray: the
reference set decides first, then the LoRAs the replicas' slots hold, then chance."""

import random

from klein.serve.replicas.affinity import Holdings, Homes, parse, ranks, routing_key

REPLICAS = ("a", "b", "c")


def route(key, homes, holdings, seed=0, replicas=REPLICAS) -> bool:
    """Route `key` as Serve would with idle replicas (to the first of the first rank, where its LoRAs are
    then counted as sent); whether that replica held them all already."""
    chosen = ranks(list(replicas), key, homes, holdings, random.Random(seed))[0][0]
    held = holdings.missing(chosen, parse(key)[1]) == 0
    holdings.sent(chosen, parse(key)[1])
    return held


def test_the_key_carries_the_set_and_the_loras():
    assert routing_key(None, ()) == ""
    assert parse(routing_key("ab12", ["oil", "ink", "ink"])) == ("ab12", frozenset({"ink", "oil"}))
    assert parse(routing_key(None, ["ink"])) == (None, frozenset({"ink"}))
    assert parse(routing_key("ab12", ())) == ("ab12", frozenset())


def test_a_lora_goes_where_a_slot_holds_it_whatever_the_draw():
    holdings = Holdings()
    holdings.sent("b", {"ink"})
    for seed in range(20):
        chosen = ranks(list(REPLICAS), routing_key(None, ["ink"]), Homes(), holdings, random.Random(seed))
        assert chosen[0] == ["b"] and sorted(chosen[1]) == ["a", "c"]


def test_the_replica_holding_more_of_the_loras_comes_first():
    holdings = Holdings()
    holdings.sent("a", {"ink"})
    holdings.sent("c", {"ink", "oil"})
    for seed in range(20):
        chosen = ranks(
            list(REPLICAS), routing_key(None, ["ink", "oil"]), Homes(), holdings, random.Random(seed)
        )
        assert chosen == [["c"], ["a", "b"]]


def test_without_a_holder_two_equal_replicas_are_offered_as_without_loras():
    chosen = ranks(list(REPLICAS), routing_key(None, ["ink"]), Homes(), Holdings(), random.Random(0))
    assert len(chosen[0]) == 2 and sorted(chosen[0] + chosen[1]) == list(REPLICAS)
    assert len(ranks(list(REPLICAS), "", Homes(), Holdings(), random.Random(0))[0]) == 2


def test_the_reference_set_decides_before_the_loras():
    homes, holdings = Homes(), Holdings()
    home = homes.home("s1", list(REPLICAS))
    other = next(r for r in REPLICAS if r != home)
    holdings.sent(other, {"ink"})
    for seed in range(10):
        chosen = ranks(list(REPLICAS), routing_key("s1", ["ink"]), homes, holdings, random.Random(seed))
        assert chosen[0] == [home], "a LoRA held elsewhere must not move a set from its home"


def test_a_new_set_is_homed_among_the_emptiest_on_the_one_holding_its_lora():
    holdings = Holdings()
    holdings.sent("c", {"ink"})
    holdings.sent("a", {"ink"})
    for seed in range(10):
        fresh = Homes()
        fresh.home("s1", ["a"])
        chosen = ranks(
            list(REPLICAS), routing_key(f"new{seed}", ["ink"]), fresh, holdings, random.Random(seed)
        )
        # "a" holds ink but has a set already: "c" has none and holds ink, "b" has none but not ink.
        assert chosen[0] == ["c"] and chosen[1] == ["b", "a"]


def test_slots_forget_the_least_recently_sent_and_dead_replicas():
    holdings = Holdings(slots=2)
    holdings.sent("a", {"ink"})
    holdings.sent("a", {"oil"})
    holdings.sent("a", {"ink"})
    holdings.sent("a", {"wax"})
    assert holdings.missing("a", ["ink", "wax", "oil"]) == 1  # oil, least recently sent, gave way
    holdings.keep_only(["b"])
    assert holdings.missing("a", ["ink"]) == 1


def test_alternating_loras_hit_their_slots_after_the_first_round():
    """Four LoRAs over two replicas, one request at a time: each LoRA's second and later requests find it
    held (a router without holdings would hit about half the time)."""
    homes, holdings = Homes(), Holdings()
    held = [
        route(routing_key(None, [f"l{i % 4}"]), homes, holdings, seed=i, replicas=("a", "b"))
        for i in range(16)
    ]
    assert held == [False] * 4 + [True] * 12
