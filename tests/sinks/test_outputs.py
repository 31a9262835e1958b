"""The alert feed's outputs against real receivers: a real rsyslogd (its own configuration,
listening on UDP, TCP and TLS, writing what it parsed to a file the test reads), a real HTTP
collector (http.server on a thread: delivered, retried after a 503, rejected on a 400), and
a file; and an output too slow for its queue, which drops its oldest alerts and says so."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from certificates import make_pki
from daemon_helpers import wait_for

from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks import cef, jsonl
from kvguard.sinks.output import Options, QueuedOutput
from kvguard.sinks.registry import format_named, open_output

BASE_NS = 1_767_258_000 * 10**9


def alert(cursor: int, severity: str = "high", message: str = "") -> svc.Alert:
    finding = pb.Finding(
        finding="stale_read",
        severity=severity,
        action="kill",
        rule="stale_read",
        node="n1",
        req=f"r{cursor}",
        tenant="acme",
        pool=0,
        pages=[cursor % 64],
        ts_ns=BASE_NS + cursor * 1_000_000,
        message=message or f"request r{cursor} read stale KV",
    )
    return svc.Alert(cursor=cursor, finding=finding)


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------- rsyslog

RSYSLOG_CONF = """
global(workDirectory="{dir}" defaultNetstreamDriverCAFile="{pki}/ca.pem"
       defaultNetstreamDriverCertFile="{pki}/daemon.pem" defaultNetstreamDriverKeyFile="{pki}/daemon.key")
module(load="imudp")
module(load="imtcp")
template(name="fields" type="string"
         string="%pri%|%timereported:::date-rfc3339%|%hostname%|%app-name%|%procid%|%msgid%|%structured-data%|%msg%\\n")
input(type="imudp" address="127.0.0.1" port="{udp}" ruleset="received")
input(type="imtcp" address="127.0.0.1" port="{tcp}" ruleset="received")
input(type="imtcp" address="127.0.0.1" port="{tls}" ruleset="received"
      streamDriver.name="ossl" streamDriver.mode="1" streamDriver.authMode="anon")
ruleset(name="received") {{ action(type="omfile" file="{out}" template="fields") }}
"""


class Rsyslog:
    def __init__(self, tmp: Path) -> None:
        (tmp / "pki").mkdir()
        self.pki = make_pki(tmp / "pki")  # its `daemon` certificate names 127.0.0.1
        self.out = tmp / "received.log"
        self.udp = free_port(socket.SOCK_DGRAM)
        self.tcp, self.tls = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_STREAM)
        conf = tmp / "rsyslog.conf"
        conf.write_text(
            RSYSLOG_CONF.format(dir=tmp, pki=self.pki, udp=self.udp, tcp=self.tcp, tls=self.tls, out=self.out)
        )
        rsyslogd = shutil.which("rsyslogd") or "/usr/sbin/rsyslogd"
        self.proc = subprocess.Popen(
            [rsyslogd, "-n", "-f", str(conf), "-i", str(tmp / "rsyslog.pid")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        wait_for(lambda: self._listening(self.tcp) and self._listening(self.tls), timeout=20)

    def _listening(self, port: int) -> bool:
        assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines() if self.out.exists() else []

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


@pytest.fixture
def rsyslog(tmp_path: Path) -> Iterator[Rsyslog]:
    server = Rsyslog(tmp_path)
    yield server
    server.stop()


def deliver(output: QueuedOutput, alerts: list[svc.Alert]) -> None:
    output.start()
    for a in alerts:
        output.offer(a)
    assert output.close(30) == 0
    assert (output.sent, output.dropped, output.rejected) == (len(alerts), 0, 0)


@pytest.mark.parametrize("transport", ["udp", "tcp", "tls"])
def test_rsyslog_receives_each_alert_as_one_rfc_5424_message(rsyslog: Rsyslog, transport: str) -> None:
    port = {"udp": rsyslog.udp, "tcp": rsyslog.tcp, "tls": rsyslog.tls}[transport]
    url = f"syslog+{transport}://127.0.0.1:{port}?facility=local4"
    sent = [alert(1, "critical"), alert(2, "high", "a = b | c \\ d, ünïcode"), alert(3, "info")]
    deliver(open_output(url, format_named("cef"), Options(ca=str(rsyslog.pki / "ca.pem"))), sent)
    wait_for(lambda: len(rsyslog.lines()) == len(sent), timeout=20)
    received = sorted((line.split("|", 7) for line in rsyslog.lines()), key=lambda r: r[0])
    by_cursor = {a.cursor: a for a in sent}
    got = {}
    for pri, ts, host, app, procid, msgid, sd, msg in received:
        cursor = int(msg.split("cn2=")[1].split()[0])
        got[cursor] = (int(pri), ts, host, app, procid, msgid, sd, msg)
    assert set(got) == {1, 2, 3}
    for cursor, (pri, ts, host, app, procid, msgid, sd, msg) in got.items():
        a = by_cursor[cursor]
        assert pri == 20 * 8 + {"critical": 2, "high": 3, "info": 6}[a.finding.severity]
        assert ts == jsonl.record(a)["time"][:26] + "Z"  # as sent: UTC, microseconds
        assert (host, app, msgid, sd) == (socket.gethostname(), "kvguard", "stale_read", "-")
        assert int(procid) > 0
        assert msg == cef.line(a)


def test_a_syslog_tls_receiver_whose_certificate_the_ca_does_not_sign_is_retried_not_fed(
    rsyslog: Rsyslog,
) -> None:
    said: list[str] = []
    url = f"syslog+tls://127.0.0.1:{rsyslog.tls}"
    output = open_output(
        url, format_named("json"), Options(ca=str(rsyslog.pki / "rogue-ca.pem"), log=said.append)
    )
    output.start()
    output.offer(alert(1))
    wait_for(lambda: any("retrying" in line for line in said))
    assert output.close(0.5) == 1 and output.sent == 0
    assert "CERTIFICATE_VERIFY_FAILED" in said[0], said
    assert rsyslog.lines() == []


# ----------------------------------------------------------------------------------- HTTP collector


class Collector:
    """A real HTTP event collector on a thread: it records each POST (path, headers, body) and
    answers with the next status of `statuses` (200 once they run out); `hold` makes it wait
    before answering (a slow SIEM)."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, str], object]] = []
        self.gets: list[str] = []  # what a client that followed a redirect as a GET asked for
        self.statuses: list[int] = []
        self.hold = threading.Event()
        self.hold.set()
        self.arrived = threading.Event()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                collector.posts.append((self.path, dict(self.headers), body))
                collector.arrived.set()
                collector.hold.wait()
                status = collector.statuses.pop(0) if collector.statuses else 200
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", "/elsewhere")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                collector.gets.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/collector"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


def test_an_http_collector_receives_each_alert_as_a_json_post(collector: Collector) -> None:
    output = open_output(
        collector.url, format_named("ocsf"), Options(headers={"Authorization": "Splunk t0ken"})
    )
    deliver(output, [alert(1), alert(2)])
    assert [body["finding_info"]["uid"] for _, _, body in collector.posts] == ["kvguard-1", "kvguard-2"]
    path, headers, body = collector.posts[0]
    assert path == "/services/collector" and headers["Authorization"] == "Splunk t0ken"
    assert headers["Content-Type"] == "application/json" and body["class_uid"] == 2004


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_an_http_redirect_is_not_followed_and_the_alert_is_rejected_not_counted_sent(
    collector: Collector, status: int
) -> None:
    collector.statuses = [status]
    said: list[str] = []
    output = open_output(collector.url, format_named("json"), Options(log=said.append))
    output.start()
    output.offer(alert(1))
    output.offer(alert(2))
    assert output.close(30) == 0
    assert collector.gets == []  # urllib's default would GET /elsewhere, without the alert
    assert [body["cursor"] for _, _, body in collector.posts] == [1, 2]
    assert (output.sent, output.rejected) == (1, 1)
    reason = f"HTTP {status} redirect to /elsewhere, not followed"
    assert said == [f"{collector.url}: alert kvguard-1 rejected: {reason}"]


def test_http_retries_a_503_with_backoff_and_skips_what_a_400_rejects(collector: Collector) -> None:
    collector.statuses = [503, 503, 400]
    said: list[str] = []
    output = open_output(collector.url, format_named("json"), Options(log=said.append))
    output.retry_first = 0.01
    output.start()
    output.offer(alert(1))  # 503, 503, then 400: rejected
    output.offer(alert(2))  # 200
    assert output.close(30) == 0
    assert [body["cursor"] for _, _, body in collector.posts] == [1, 1, 1, 2]
    assert (output.sent, output.rejected, output.dropped) == (1, 1, 0)
    assert said == [
        f"{collector.url}: HTTP 503 Service Unavailable; retrying",
        f"{collector.url}: alert kvguard-1 rejected: HTTP 400 Bad Request",
        f"{collector.url}: delivering again",
    ]


def test_a_slow_output_drops_its_oldest_alerts_and_says_how_many_in_band(collector: Collector) -> None:
    collector.hold.clear()  # the collector takes the first POST and does not answer yet
    said: list[str] = []
    output = open_output(collector.url, format_named("json"), Options(capacity=3, log=said.append))
    output.start()
    output.offer(alert(1))
    assert collector.arrived.wait(10)  # alert 1 is in flight, the queue empty
    for cursor in range(2, 10):  # 8 more into a queue of 3: 2..6 dropped, 7, 8, 9 kept
        output.offer(alert(cursor))
    assert output.dropped == 5 and output.pending() == 3
    collector.hold.set()
    assert output.close(30) == 0
    bodies = [body for _, _, body in collector.posts]
    assert [b["cursor"] for b in bodies] == [1, 0, 7, 8, 9]
    notice = bodies[1]
    assert notice["finding"] == "alerts_dropped" and notice["uid"] == "kvguard-dropped-2-6"
    assert notice["details"] == {
        "dropped": "5",
        "first_cursor": "2",
        "last_cursor": "6",
        "output": collector.url,
    }
    assert "5 alert(s) dropped" in notice["message"]
    assert (output.sent, output.notices, output.dropped) == (4, 1, 5)
    assert said == [f"{collector.url}: 5 alert(s) dropped (queue full: the output was slow or down)"]


def test_a_file_output_appends_one_line_per_alert(tmp_path: Path) -> None:
    path = tmp_path / "alerts.jsonl"
    path.write_text('{"earlier": true}\n')
    deliver(open_output(f"file://{path}", format_named("json")), [alert(1), alert(2)])
    lines = path.read_text().splitlines()
    assert lines[0] == '{"earlier": true}' and [json.loads(x)["cursor"] for x in lines[1:]] == [1, 2]


@pytest.mark.parametrize(
    ("url", "port"), [("syslog+udp://siem", 514), ("syslog+tcp://siem", 514), ("syslog+tls://siem", 6514)]
)
def test_a_syslog_output_without_a_port_takes_its_transports_default(url: str, port: int) -> None:
    output = open_output(url, format_named("json"))
    assert (output.host, output.port) == ("siem", port)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("smtp://x", "unknown output"),
        ("syslog+tcp://:514", "syslog+tcp://host[:port]"),
        ("syslog+udp://h:99999", "port is not a number"),
        ("syslog+udp://h:514?facility=nope", "facility 'nope'"),
        ("file://relative/path", "file:///absolute/path"),
    ],
)
def test_an_unusable_output_url_is_an_error_naming_it(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)) as err:
        open_output(url, format_named("json"))
    assert str(err.value).startswith(url)
