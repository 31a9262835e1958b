"""The services' configuration, as an operator writes it: kvguard.yaml, its conf.d drop-ins,
KVGUARD_* variables and flags, in that order of strength; `config show` says each value and
where it came from, `config check` names a bad file's key and reason, and a daemon started
on the file runs as it says (its store where the file puts it)."""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from service_user import service_user

from kvguard.cli.process import Service


def kvguard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    return subprocess.run(
        [sys.executable, "-m", "kvguard", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean | (env or {}),
    )


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_files_dropins_environment_and_flags_in_that_order(tmp_path: Path) -> None:
    main = write(
        tmp_path / "kvguard.yaml",
        "daemon:\n  listen: 127.0.0.1:7000\n  store: /var/lib/kvguard/a.db\n  mode: monitor\n"
        "  snapshot-every: 1000\nagent:\n  daemon: kvg.example\n",
    )
    write(tmp_path / "conf.d" / "10-store.yaml", "daemon:\n  store: /srv/b.db\n  clock_skew_ms: 2.5\n")
    write(tmp_path / "conf.d" / "20-later.yml", "daemon:\n  store: /srv/c.db\n")
    write(tmp_path / "conf.d" / "notes.txt", "not: read\n")  # not a drop-in
    env = {"KVGUARD_DAEMON_MODE": "enforce", "KVGUARD_CONFIG": str(main)}
    shown = kvguard("config", "show", "daemon", "-o", "json", env=env)
    assert shown.returncode == 0, shown.stderr
    rows = {r["option"]: (str(r["value"]), r["source"]) for r in json.loads(shown.stdout)}
    assert rows["listen"] == ("127.0.0.1:7000", str(main))
    assert rows["store"] == ("/srv/c.db", str(tmp_path / "conf.d" / "20-later.yml"))  # the later drop-in
    assert rows["clock-skew-ms"] == ("2.5", str(tmp_path / "conf.d" / "10-store.yaml"))
    assert rows["mode"] == ("enforce", "env KVGUARD_DAEMON_MODE")
    assert rows["snapshot-every"] == ("1000", str(main))
    assert rows["insecure"] == ("False", "default")
    agent = json.loads(kvguard("config", "show", "agent", "-o", "json", env=env).stdout)
    assert {r["option"]: r["value"] for r in agent}["daemon"] == "kvg.example:7463"  # the default port
    table = kvguard("config", "show", "daemon", env=env).stdout
    assert any(line.split()[:2] == ["daemon.store", "/srv/c.db"] for line in table.splitlines()), table
    check = kvguard("config", "check", env=env)
    assert check.returncode == 0 and "6 setting(s)" in check.stdout and str(main) in check.stdout


def test_a_daemon_runs_as_its_file_says_and_its_flags_win(tmp_path: Path) -> None:
    store = tmp_path / "from-file.db"
    main = write(
        tmp_path / "kvguard.yaml", f"daemon:\n  listen: 127.0.0.1:0\n  store: {store}\n  mode: monitor\n"
    )
    daemon = Service("daemon", "--config", str(main), ready="READY ")
    try:
        assert store.exists()  # the store is the file's
    finally:
        daemon.stop()
    flagged = tmp_path / "from-flag.db"
    daemon = Service("daemon", "--config", str(main), "--store", str(flagged), ready="READY ")
    try:
        assert flagged.exists()
    finally:
        daemon.stop()


def test_a_bad_configuration_is_named_with_its_reason(tmp_path: Path) -> None:
    cases = {
        "daemon:\n  lisen: 127.0.0.1:7000\n": "daemon: unknown option 'lisen' (did you mean 'listen'?)",
        "deamon:\n  listen: x\n": "unknown section 'deamon' (did you mean 'daemon'?)",
        "daemon:\n  mode: audit\n": "daemon: mode: 'audit' is not one of monitor, enforce",
        "daemon:\n  snapshot-every: lots\n": "daemon: snapshot-every: 'lots': ",
        "daemon:\n  insecure: maybe\n": "daemon: insecure: 'maybe' is not true or false",
        "daemon:\n  listen: [a, b]\n": "daemon: listen: takes one value, not list",
        "- daemon\n": "not a mapping of sections (daemon, agent)",
        "daemon: [1]\n": "section 'daemon' is not a mapping of options",
        # YAML that does not parse: file:line:column: reason, on one line
        "daemon:\n  listen: 'a\n": ":3:1: not YAML: found unexpected end of stream (while scanning a quoted",
        "daemon:\n\tlisten: 1\n": ":2:1: not YAML: found character '\\t' that cannot start any token",
    }
    for text, said in cases.items():
        main = write(tmp_path / "kvguard.yaml", text)
        check = kvguard("config", "check", "--config", str(main))
        assert check.returncode == 2, (text, check.stdout)
        assert check.stderr.startswith(f"kvguard config: {main}") and said in check.stderr, (
            text,
            check.stderr,
        )
        assert "Traceback" not in check.stderr and len(check.stderr.splitlines()) == 1
    # The environment's values are checked as the files' are; the service refuses to start.
    ok = write(tmp_path / "kvguard.yaml", "daemon:\n  listen: 127.0.0.1:0\n")
    bad = kvguard("daemon", "--config", str(ok), env={"KVGUARD_DAEMON_CLOCK_SKEW_MS": "soon"})
    assert (
        bad.returncode == 2
        and "env KVGUARD_DAEMON_CLOCK_SKEW_MS: daemon: clock-skew-ms: 'soon'" in bad.stderr
    )
    assert "Traceback" not in bad.stderr
    # A misspelt variable is not ignored in silence: check finds it, and the service refuses it.
    for command in (("config", "check"), ("daemon",)):
        typo = kvguard(*command, "--config", str(ok), env={"KVGUARD_DAEMON_LISEN": "0.0.0.0:7463"})
        assert typo.returncode == 2 and "Traceback" not in typo.stderr, typo.stderr
        assert (
            "env KVGUARD_DAEMON_LISEN: daemon has no such option (did you mean KVGUARD_DAEMON_LISTEN?)"
            in typo.stderr
        )
    opts = kvguard("config", "check", "--config", str(ok), env={"KVGUARD_DAEMON_OPTS": "--mode monitor"})
    assert opts.returncode == 0, opts.stderr  # the units' extra flags, not a setting
    missing = kvguard("config", "check", "--config", str(tmp_path / "nope.yaml"))
    assert (
        missing.returncode == 2 and f"{tmp_path / 'nope.yaml'}: no such configuration file" in missing.stderr
    )


def test_the_shipped_example_is_a_usable_configuration() -> None:
    # Every value is of its option's kind; what check still finds on a host not set up for it
    # is only the host's files it names (certificates, the rules directory), each said.
    example = Path(__file__).resolve().parents[2] / "deploy" / "kvguard.yaml"
    check = kvguard("config", "check", "--config", str(example))
    problems = check.stderr.splitlines()
    assert all(p.endswith((": no such file", ": no such directory")) for p in problems), check.stderr
    assert check.returncode == (2 if problems else 0)
    assert all(p.startswith("kvguard config: ") and "/etc/kvguard/" in p for p in problems)
    rows = json.loads(kvguard("config", "show", "daemon", "--config", str(example), "-o", "json").stdout)
    assert {r["option"]: r["source"] for r in rows}["metrics-listen"] == str(example)


def test_check_finds_what_would_stop_the_service_and_rules_install_fills_the_directory(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Values of the right type that still cannot run: TLS files that are not there, a rules
    # directory with no rules. Each is named with the option and the file; `rules install`
    # puts the bundled rules where `rules:` points, and then it checks.
    # As root the host has the units' kvguard user, and config check asks whether it can read
    # the TLS files: they go where it can walk, given to it as the documented sequence does.
    owner = ["--owner", "kvguard"] if service_user() else []
    rules = tmp_path / "rules"
    rules.mkdir()
    walkable = Path(tempfile.mkdtemp(prefix="kvguard-pki-", dir="/var/tmp"))
    walkable.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(walkable, ignore_errors=True))
    pki = walkable / "pki"
    if owner:  # as the packaged tmpfiles.d makes /etc/kvguard/pki
        pki.mkdir(mode=0o750)
        os.chown(pki, 0, grp.getgrnam("kvguard").gr_gid)
    main = write(
        tmp_path / "kvguard.yaml",
        f"daemon:\n  rules: {rules}\n  tls-ca: {pki}/ca.pem\n  tls-cert: {pki}/daemon.pem\n"
        f"  tls-key: {pki}/daemon.key\n",
    )
    check = kvguard("config", "check", "--config", str(main))
    assert check.returncode == 2 and "usable" not in check.stdout
    for option, file in (("tls-ca", "ca.pem"), ("tls-cert", "daemon.pem"), ("tls-key", "daemon.key")):
        assert f"kvguard config: daemon: {option}: {pki / file}: no such file" in check.stderr
    assert f"daemon: rules: {rules}: holds no rules (*.yaml): `kvguard rules install {rules}`" in check.stderr
    installed = kvguard("rules", "install", str(rules))
    assert installed.returncode == 0 and f"{rules / '10-leaks.yaml'}: installed" in installed.stdout
    assert "kept (the same as the packaged one)" in kvguard("rules", "install", str(rules)).stdout
    assert kvguard("certs", "init", str(pki), *owner).returncode == 0
    check = kvguard("config", "check", "--config", str(main))
    assert check.returncode == 0 and "configuration usable" in check.stdout, check.stderr
