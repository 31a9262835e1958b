"""The systemd units of deploy/systemd/, checked by systemd's own tools in a scratch root that
holds what they name: /usr/bin/kvguard (a launcher of this checkout's kvguard), /bin/kill and
this machine's own units (the targets they are ordered against). `systemd-analyze verify`
reports a line it cannot parse as a warning and still exits 0, so its output must be empty."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
UNITS = ("kvguard-daemon.service", "kvguard-agent.service")  # the services (sd_notify, watchdog)
ALERTS = "kvguard-alerts.service"  # the alert feed: a client, no notify
NATS = "kvguard-nats@.service"  # a server of the bus's JetStream cluster (verified as instance 1)
ANALYZE = "/usr/bin/systemd-analyze"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A scratch root with the units installed, and the programs and units they name."""
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "usr/lib/systemd").mkdir(parents=True)
    launcher = root / "usr/bin/kvguard"
    launcher.write_text(f'#!/bin/sh\nexec {sys.executable} -m kvguard "$@"\n')
    launcher.chmod(0o755)
    shutil.copy2(Path(sys.executable).parent / "nats-server", root / "usr/bin/nats-server")
    shutil.copy2(os.path.realpath("/bin/kill"), root / "bin/kill")
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for name in (*UNITS, ALERTS, NATS):
        shutil.copy2(DEPLOY / name, units / name)
    return root


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=120, check=False)


def settings(name: str) -> dict[str, list[str]]:
    """A unit's settings, each with every value it is given, in order."""
    found: dict[str, list[str]] = {}
    for line in (DEPLOY / name).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def test_systemd_verifies_the_units_without_a_word(root: Path) -> None:
    done = analyze("verify", f"--root={root}", *UNITS, ALERTS, NATS.replace("@", "@1"))
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
    # The launcher it found is a working kvguard.
    launched = subprocess.run(
        [str(root / "usr/bin/kvguard"), "daemon", "--help"], capture_output=True, text=True, timeout=120
    )
    assert launched.returncode == 0 and "--listen" in launched.stdout


def test_verify_would_say_a_broken_unit_and_a_missing_program(root: Path) -> None:
    # What the test above relies on: a line systemd cannot parse is said (exit 0), a program
    # the unit runs that is not there fails.
    unit = root / "etc/systemd/system" / UNITS[0]
    unit.write_text(unit.read_text().replace("Type=notify\n", "Type=notifyy\n"))
    said = analyze("verify", f"--root={root}", UNITS[0])
    assert "Failed to parse service type, ignoring: notifyy" in said.stderr
    (root / "usr/bin/kvguard").unlink()
    missing = analyze("verify", f"--root={root}", UNITS[1])
    assert missing.returncode != 0 and "Command /usr/bin/kvguard is not executable" in missing.stderr


@pytest.mark.parametrize("name", UNITS)
def test_both_units_tell_systemd_how_they_are(name: str) -> None:
    unit = settings(name)
    assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
    assert unit["WatchdogSec"] == ["30s"] and unit["Restart"] == ["on-failure"]
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert unit["ExecStart"][0].startswith(f"/usr/bin/kvguard {name.split('-')[1].split('.')[0]} ")
    assert unit["RestartPreventExitStatus"] == ["2"]  # a refused start is not retried
    for hardened in ("NoNewPrivileges", "PrivateTmp", "ProtectKernelTunables", "ProtectControlGroups"):
        assert unit[hardened] == ["yes"], hardened
    assert unit["ProtectSystem"] == ["strict"] and unit["LockPersonality"] == ["yes"]
    assert unit["SystemCallFilter"][0].startswith("@system-service")


def test_the_daemon_runs_as_kvguard_with_no_capability() -> None:
    unit = settings("kvguard-daemon.service")
    assert unit["User"] == ["kvguard"] and unit["CapabilityBoundingSet"] == [""]
    assert unit["PrivateDevices"] == ["yes"] and unit["MemoryDenyWriteExecute"] == ["yes"]
    assert unit["ExecStart"] == ["/usr/bin/kvguard daemon $KVGUARD_DAEMON_OPTS"]
    assert unit["WorkingDirectory"] == ["%S/kvguard"]  # where the store's relative default lands


def test_the_agent_gets_the_ebpf_capabilities_and_the_gpus_only() -> None:
    unit = settings("kvguard-agent.service")
    assert unit["CapabilityBoundingSet"] == unit["AmbientCapabilities"] == ["CAP_BPF CAP_PERFMON"]
    assert unit["LimitMEMLOCK"] == ["infinity"]  # instead of CAP_SYS_RESOURCE
    assert "PrivateDevices" not in unit and unit["DevicePolicy"] == ["closed"]
    assert all(device.startswith("char-nvidia") for device in unit["DeviceAllow"])
    assert unit["SystemCallFilter"] == ["@system-service bpf perf_event_open"]
    assert "MemoryDenyWriteExecute" not in unit


def test_the_alert_feed_resumes_from_its_cursor_file_as_kvguard() -> None:
    unit = settings(ALERTS)
    assert unit["ExecStart"] == [
        "/usr/bin/kvguard alerts --follow --cursor-file %S/kvguard-alerts/cursor $KVGUARD_ALERTS_OPTS"
    ]
    assert unit["StateDirectory"] == ["kvguard-alerts"] and unit["User"] == ["kvguard"]
    assert unit["Restart"] == ["always"] and unit["CapabilityBoundingSet"] == [""]


def test_a_bus_server_runs_its_own_file_as_kvguard_and_leaves_in_lame_duck_mode() -> None:
    unit = settings(NATS)
    assert unit["ExecStart"] == ["/usr/bin/nats-server -c /etc/kvguard/nats/server-%i.conf"]
    assert unit["User"] == ["kvguard"] and unit["CapabilityBoundingSet"] == [""]
    assert unit["KillSignal"] == ["SIGUSR2"] and unit["StateDirectory"] == ["kvguard-nats"]


# systemd's exposure levels, tenfold (1.7 is 17), at most: the daemon's, the agent's (root, eBPF),
# the alert feed's.
@pytest.mark.parametrize(
    ("name", "most"), [(UNITS[0], 20), (UNITS[1], 30), (ALERTS, 20), (NATS.replace("@", "@1"), 20)]
)
def test_systemd_rates_the_units_exposure_low(root: Path, name: str, most: int) -> None:
    done = analyze("security", "--offline=yes", f"--root={root}", f"--threshold={most}", name)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    assert f"Overall exposure level for {name}: " in done.stdout


def test_sysusers_and_tmpfiles_make_the_user_and_its_directories(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for tool, conf in (("sysusers", "kvguard.sysusers.conf"), ("tmpfiles", "kvguard.tmpfiles.conf")):
        args = [f"/usr/bin/systemd-{tool}", f"--root={root}", *(["--create"] if tool == "tmpfiles" else [])]
        done = subprocess.run([*args, str(DEPLOY / conf)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    user = next(line.split(":") for line in (root / "etc/passwd").read_text().splitlines())
    assert user[0] == "kvguard" and user[5:] == ["/var/lib/kvguard", "/usr/sbin/nologin"]
    uid, gid = int(user[2]), int(user[3])
    paths = (
        "etc/kvguard",
        "etc/kvguard/rules",
        "etc/kvguard/pki",
        "var/lib/kvguard",
        "var/lib/kvguard-agent",
    )
    made = {}
    for path in (*paths, "var/log/kvguard"):
        st = os.stat(root / path)
        made[path] = (st.st_mode & 0o777, st.st_uid, st.st_gid)
    assert made == {
        "etc/kvguard": (0o750, 0, gid),
        "etc/kvguard/rules": (0o750, 0, gid),
        "etc/kvguard/pki": (0o750, 0, gid),  # certs init --owner kvguard writes the service's keys here
        "var/lib/kvguard": (0o750, uid, gid),
        "var/lib/kvguard-agent": (0o700, 0, 0),
        "var/log/kvguard": (0o750, uid, gid),
    }
