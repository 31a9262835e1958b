"""The alert feed's one registry (sinks/registry.py): every encoding and transport registered
works through it, is offered by `kvguard alerts`, and is documented where operators read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks.output import QueuedOutput
from kvguard.sinks.registry import FORMATS, TRANSPORTS, format_named, open_output

ROOT = Path(__file__).resolve().parents[2]
SERVICE_DOC = (ROOT / "docs" / "service.md").read_text()
EXAMPLE_URLS = {
    "syslog+udp": "syslog+udp://siem.example",
    "syslog+tcp": "syslog+tcp://siem.example:1514",
    "syslog+tls": "syslog+tls://siem.example?facility=auth",
    "http": "http://siem.example/collector",
    "https": "https://siem.example/collector",
    "file": "file:///var/log/kvguard/alerts.jsonl",
}


def awkward_alert() -> svc.Alert:
    """An alert whose every free-text field holds what could break a line or a field."""
    text = 'line one\nline two\r\n| = \\ "quoted" ünïcode'
    finding = pb.Finding(
        finding="stale_read", severity="critical", action="kill", rule=text, node=text, req=text,
        tenant=text, victim_tenant=text, message=text, pool=0, pages=[1, 2], ts_ns=10**18,
        details={"victim_req": text},
    )  # fmt: skip
    return svc.Alert(cursor=7, finding=finding)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_registered_encoding_writes_one_line_and_a_json_body(name: str) -> None:
    fmt = format_named(name)
    line = fmt.line(awkward_alert())
    assert line and "\n" not in line and "\r" not in line
    assert "line one" in line  # the content is there, escaped, not dropped
    json.dumps(fmt.body(awkward_alert()))  # what an HTTP POST carries is JSON
    assert f"`{name}`" in SERVICE_DOC, f"docs/service.md does not list the encoding {name}"


def test_every_transport_has_an_example_here() -> None:
    assert set(EXAMPLE_URLS) == set(TRANSPORTS)


@pytest.mark.parametrize("scheme", sorted(TRANSPORTS))
def test_each_registered_transport_opens_from_its_url(scheme: str) -> None:
    output = open_output(EXAMPLE_URLS[scheme], format_named("json"))
    assert isinstance(output, QueuedOutput) and output.name == EXAMPLE_URLS[scheme]
    output.close(0)  # never started: nothing to deliver, nothing lost
    assert f"`{scheme}://`" in SERVICE_DOC, f"docs/service.md does not list the output {scheme}://"


def test_an_unregistered_scheme_is_refused_with_the_ones_there_are() -> None:
    with pytest.raises(ValueError) as err:
        open_output("kafka://broker:9092/alerts", format_named("json"))
    assert (
        str(err.value)
        == "kafka://broker:9092/alerts: unknown output (one of "
        + ", ".join(f"{s}://" for s in TRANSPORTS)
        + ")"
    )


def test_kvguard_alerts_offers_what_the_registry_holds() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "kvguard", "alerts", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"--format \{(.*?)\}", shown).group(1).split(",") == list(FORMATS)  # type: ignore[union-attr]
    flat = " ".join(shown.split())
    for scheme in TRANSPORTS:
        assert f"{scheme}://" in flat


def test_building_the_parser_loads_no_encoding_or_transport() -> None:
    probe = (
        "import sys; import kvguard.cli.alerts; "
        "loaded = [m for m in sys.modules if m.startswith('kvguard.sinks.')"
        " and m != 'kvguard.sinks.registry']; "
        "print(loaded)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
