"""The roles' addresses in waves and as changes (what a large job's heartbeats carry), the agent's side that applies
them, and the least-loaded choice of a placing pass."""

from __future__ import annotations

import json

from convoy.control.protocol import messages as p
from convoy.control.roles.address_book import KEPT_WAVES, AddressBook, Changes, Wave, wave_for
from convoy.control.roles.placement import Choice, LeastLoaded, Need, NodeRoom, Taken, choose


def reply_with(encoded: bytes, version: int) -> p.HeartbeatResponse:
    head = b'{"job_status":"running","round_id":1,"addresses_version":%d' % version
    return p.HeartbeatResponse.model_validate_json(head + (b"," + encoded if encoded else b"") + b"}")


def test_a_node_behind_by_a_kept_wave_gets_only_the_changes_and_holds_the_same_addresses() -> None:
    book = AddressBook()
    assert book.publish(Wave(1, {"a": ["h:1", ""]}, {"a": [1, 1]}), now=0.0)
    assert isinstance(book.for_node(0), Wave), "a node holding nothing is sent the whole wave"
    first = reply_with(book.encoded(0), 1)
    held_addresses, held_incarnations = first.addresses, first.incarnations
    assert held_addresses == {"a": ["h:1", ""]} and first.address_changes is None
    assert book.publish(Wave(2, {"a": ["h:1", "h:2", "h:3"], "b": ["h:9"]}, {"a": [1, 1, 1], "b": [1]}), now=1.0)
    sent = book.for_node(1)
    assert isinstance(sent, Changes) and sent.addresses == {"a": {1: "h:2", 2: "h:3"}, "b": {0: "h:9"}}
    second = reply_with(book.encoded(1), 2)
    assert second.addresses == {} and second.address_changes is not None and second.address_changes.since == 1
    assert second.address_changes.applied_to(held_addresses, held_incarnations) == (
        {"a": ["h:1", "h:2", "h:3"], "b": ["h:9"]}, {"a": [1, 1, 1], "b": [1]})
    assert book.for_node(2) is None and book.encoded(2) == b"", "a node holding the wave is sent nothing"


def test_a_role_that_shrank_is_cut_and_a_node_too_far_behind_gets_everything() -> None:
    book = AddressBook()
    book.publish(Wave(1, {"a": ["x", "y", "z"]}, {"a": [1, 1, 1]}), now=0.0)
    book.publish(Wave(2, {"a": ["x"]}, {"a": [1]}), now=1.0)
    changes = reply_with(book.encoded(1), 2).address_changes
    assert changes is not None and changes.applied_to({"a": ["x", "y", "z"]}, {"a": [1, 1, 1]}) == (
        {"a": ["x"]}, {"a": [1]})
    for version in range(3, 4 + KEPT_WAVES):
        book.publish(Wave(version, {"a": [f"x{version}"]}, {"a": [version]}), now=float(version))
    assert isinstance(book.for_node(1), Wave), "its wave is no longer kept"
    assert book.publish(Wave(3 + KEPT_WAVES, {}, {}), now=99.0) is False, "the same version is no new wave"


def test_waves_are_spaced_by_the_number_of_nodes_and_json_keys_come_back_as_indices() -> None:
    book = AddressBook()
    assert book.due(0.0, wave_for(4096)) and wave_for(4096) > 4 * wave_for(1024) - 1e-9
    book.publish(Wave(1, {"a": [""]}, {"a": [1]}), now=10.0)
    assert not book.due(10.0 + wave_for(4096) / 2, wave_for(4096)) and book.due(10.0 + wave_for(4096), wave_for(4096))
    book.publish(Wave(2, {"a": ["h:1"]}, {"a": [2]}), now=20.0)
    raw = json.loads(b"{" + book.encoded(1) + b"}")["address_changes"]
    assert raw == {"since": 1, "sizes": {"a": 1}, "addresses": {"a": {"0": "h:1"}}, "incarnations": {"a": {"0": 2}}}


def test_least_loaded_picks_as_choose_does_for_processes_that_declare_nothing() -> None:
    nodes = [f"n{i}" for i in range(7)]
    taken_a = {"n2": Taken(processes=2), "n5": Taken(processes=1)}
    taken_b = {key: Taken(processes=value.processes) for key, value in taken_a.items()}
    least = LeastLoaded(nodes, taken_b)
    rooms = {node: NodeRoom() for node in nodes}
    for home in ["", "", "n2", "", "", "", "", "", "n9", "", ""]:
        expected = choose(nodes, rooms, taken_a, Need(), home)
        got = least.choose(home)
        assert got == expected, (home, got, expected)
        assert isinstance(got, Choice)
        for taken in (taken_a, taken_b):
            taken.setdefault(got.node_id, Taken()).add(Need(), ())
    assert LeastLoaded([], {}).choose() is None
