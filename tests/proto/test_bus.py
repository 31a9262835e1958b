"""The bus's names (proto/bus.py): any node name is one subject token that reads back as the
name, so a dot, a wildcard or a space in a name cannot widen a subject or a permission."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.proto import bus


@given(st.text(min_size=1, max_size=40))
def test_any_name_is_one_token_that_reads_back(name: str) -> None:
    tok = bus.token(name)
    assert bus.untoken(tok) == name
    assert not set(tok) & {".", "*", ">", " ", "\t", "\n", "\r"}


@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_distinct_names_are_distinct_tokens(a: str, b: str) -> None:
    assert (bus.token(a) == bus.token(b)) == (a == b)


def test_a_subject_says_whose_it_is() -> None:
    subject = bus.events_subject("fleet", "pd-7", "decode.0/ebpf")
    assert subject == "kvguard.v1.fleet.pd-7.decode%2E0.ebpf"
    assert bus.parse_subject(subject) == bus.Subject("fleet", "pd-7", "decode.0/ebpf")
    assert bus.parse_subject(bus.events_subject("fleet", "pd-7", "p*")).source == "p*"
    with pytest.raises(bus.BusError, match=r"is not kvguard\.v1"):
        bus.parse_subject("kvguard.v1.fleet.pd-7")


def test_a_nodes_permissions_name_only_its_subjects() -> None:
    allowed = bus.node_permissions("fleet", "d>0")
    assert allowed["publish"]["allow"] == [
        "kvguard.v1.fleet.*.d%3E0",
        "kvguard.v1.fleet.*.d%3E0.*",
        "kvguard.ctl.fleet.d%3E0.status",
        "$JS.API.DIRECT.GET.KVGUARD_fleet.kvguard.v1.fleet.*.d%3E0",
        "$JS.API.DIRECT.GET.KVGUARD_fleet.kvguard.v1.fleet.*.d%3E0.*",
    ]
    assert allowed["subscribe"]["allow"] == ["kvguard.ctl.fleet.d%3E0.cmd"]


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", "x" * 65])
def test_cluster_and_cell_names_that_cannot_name_a_stream_are_refused(bad: str) -> None:
    with pytest.raises(bus.BusError):
        bus.check_cluster(bad)
    with pytest.raises(bus.BusError):
        bus.check_cell(bad)


def test_a_batchs_last_position_reads_back() -> None:
    assert bus.parse_last(bus.last_header((3, 17))) == (3, 17)
    assert bus.parse_last(None) == bus.parse_last("x:y") == (0, 0)
