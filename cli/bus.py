"""`kvguard bus config`: the configuration of a NATS JetStream cluster for kvguard's bus
(proto/bus.py): one file per server (its client and route ports on one host, or each on its
own host), and a user for the daemons and for each agent, whose password is written to a
file of its own (mode 0600) for `--bus-password-file`.

Invariant: an agent's user may publish only the events and status of the nodes it is given
(`--agent host-1=prefill-0,decode-0`), read back only their own last messages, and hear only
their commands; the daemons' user may do anything on the bus. Passwords are made here, 32
random bytes each; a password file already there is kept (a re-run does not log every agent
out), and the server files name them in plain text: they are written owner-only.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

from kvguard.cli.options import Subcommands, add_command, add_group, positive_count
from kvguard.proto.bus import BusError, check_cluster, inbox, node_permissions
from kvguard.proto.channel import MAX_MESSAGE

DAEMON_USER = "kvguard-daemon"


def _password(directory: Path, user: str) -> str:
    """The user's password, made once and kept in `directory/<user>` (0600)."""
    path = directory / user
    if path.exists():
        return path.read_text().strip()
    word = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(word + "\n")
    return word


def _agents(specs: list[str]) -> dict[str, list[str]]:
    """`user=node,node` specs as {user: nodes} (BusError naming a spec that is not one)."""
    agents: dict[str, list[str]] = {}
    for spec in specs:
        user, _, nodes = spec.partition("=")
        names = [n for n in nodes.split(",") if n]
        if not user or not names or "/" in user or user == DAEMON_USER:
            raise BusError(f"--agent {spec!r} is not USER=NODE[,NODE...] (USER not {DAEMON_USER}, no '/')")
        agents.setdefault(user, []).extend(names)
    return agents


def server_configs(
    cluster: str,
    servers: int,
    host: str,
    port: int,
    route_port: int,
    data: Path,
    users: list[dict[str, object]],
    tls: dict[str, str] | None = None,
) -> list[str]:
    """Each server's configuration (NATS's format; JSON is a subset of it)."""
    routes = [f"nats-route://{host}:{route_port + i}" for i in range(servers)]
    configs = []
    for i in range(servers):
        config: dict[str, object] = {
            "server_name": f"kvguard-{cluster}-{i + 1}",
            "listen": f"{host}:{port + i}",
            "max_payload": MAX_MESSAGE,  # an agent's largest batch, as the daemon's gRPC takes it
            "jetstream": {"store_dir": str(data / f"server-{i + 1}")},
            "accounts": {"KVGUARD": {"jetstream": "enabled", "users": users}},
        }
        if tls is not None:  # clients must speak TLS: no password crosses the network in the clear
            config["tls"] = tls
        if servers > 1:
            config["cluster"] = {
                "name": f"kvguard-{cluster}",
                "listen": f"{host}:{route_port + i}",
                "routes": routes,
            }
        configs.append(json.dumps(config, indent=2) + "\n")
    return configs


def cmd_bus(args: argparse.Namespace) -> int:
    try:
        check_cluster(args.cluster)
        agents = _agents(args.agent or [])
    except BusError as exc:
        print(f"kvguard bus config: {exc}", file=sys.stderr)
        return 2
    out = Path(args.dir)
    passwords = out / "passwords"
    passwords.mkdir(parents=True, exist_ok=True, mode=0o700)
    users: list[dict[str, object]] = [{"user": DAEMON_USER, "password": _password(passwords, DAEMON_USER)}]
    for user, nodes in agents.items():
        allowed: dict[str, dict[str, list[str]]] = {"publish": {"allow": []}, "subscribe": {"allow": []}}
        for node in nodes:
            for verb, rules in node_permissions(args.cluster, node).items():
                allowed[verb]["allow"] += [s for s in rules["allow"] if s not in allowed[verb]["allow"]]
        allowed["subscribe"]["allow"].append(f"{inbox(user)}.>")  # its replies, no one else's
        users.append({"user": user, "password": _password(passwords, user), "permissions": allowed})
    data = Path(args.data) if args.data else out / "data"
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            print("kvguard bus config: --tls-cert and --tls-key go together", file=sys.stderr)
            return 2
        tls = {"cert_file": str(Path(args.tls_cert).resolve()), "key_file": str(Path(args.tls_key).resolve())}
    configs = server_configs(
        args.cluster, args.servers, args.host, args.port, args.route_port, data, users, tls
    )
    for i, text in enumerate(configs):
        path = out / f"server-{i + 1}.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)
    urls = ",".join(f"nats://{args.host}:{args.port + i}" for i in range(args.servers))
    print(f"wrote {len(configs)} server configuration(s) and {len(users)} password file(s) to {out}")
    print(f"start each:  nats-server -c {out}/server-N.conf   (or: systemctl start kvguard-nats@N)")
    tls_note = " --bus-tls-ca CA.pem (the CA of --tls-cert)" if tls is not None else ""
    print(
        f"daemons:     --bus {urls} --bus-cluster {args.cluster} --bus-user {DAEMON_USER} "
        f"--bus-password-file {passwords}/{DAEMON_USER}{tls_note}"
    )
    return 0


def add_parser(sub: Subcommands) -> None:
    """Add `bus config` to the `kvguard` subcommands."""
    verbs = add_group(
        sub,
        "bus",
        "the NATS JetStream bus between agents and daemons, past one daemon",
        "Configure the NATS JetStream cluster that carries the fleet's events to its daemons.",
        "kvguard bus config --cluster fleet --dir /etc/kvguard/nats --agent host-1=prefill-0,decode-0",
    )
    p = add_command(
        verbs,
        "config",
        "write a JetStream cluster's server files and its users' passwords",
        "Write one NATS server configuration per server, a user for the daemons and one per agent.",
        "kvguard bus config --cluster fleet --dir /etc/kvguard/nats --agent host-1=prefill-0,decode-0",
    )
    p.add_argument("--cluster", required=True, help="the kvguard cluster's name (A-Z a-z 0-9 _ -)")
    p.add_argument("--dir", required=True, help="where the server files and passwords/ go")
    p.add_argument("--data", help="the servers' JetStream storage (default: DIR/data)")
    p.add_argument("--servers", type=positive_count, default=3, help="servers in the JetStream cluster")
    p.add_argument("--host", default="127.0.0.1", help="the address the servers listen on")
    p.add_argument("--port", type=int, default=4222, help="the first server's client port (then +1 each)")
    p.add_argument(
        "--route-port", type=int, default=6222, help="the first server's route port (then +1 each)"
    )
    p.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="the servers' certificate (`kvguard certs init --daemon-host HOST` makes one): clients must use "
        "TLS (--bus-tls-ca); routes between the servers stay plaintext: keep them on a private network",
    )
    p.add_argument("--tls-key", metavar="PEM", help="the servers' private key")
    p.add_argument(
        "--agent",
        action="append",
        metavar="USER=NODE[,NODE...]",
        help="an agent's bus user and the nodes it speaks for (repeatable)",
    )
    p.set_defaults(func=cmd_bus)
