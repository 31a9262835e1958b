"""`kvguard bus config`: the configuration of a NATS JetStream cluster for kvguard's bus
(proto/bus.py): one file per server (its client and route ports on one host, or each on its
own host), and a user for the daemons and for each agent. Either each user has a password,
written to a file of its own (mode 0600) for `--bus-password-file`; or, with `--tls-ca`, each
client is known by its certificate from the kvguard CA (NATS's verify_and_map): an agent by
its node certificate (`--agent-cert`), a daemon by its own (`--daemon-cert`), no password
exists, and the servers' routes are mutual TLS too.

Invariant: an agent's user may publish only the events and status of the nodes it is given
(`--agent host-1=prefill-0,decode-0`, or the nodes its certificate names), read back only
their own last messages, and hear only their commands; the daemons' user may do anything on
the bus. A certificate is taken only if the CA signed it for a client and it is of its role
(a node's for an agent, a daemon's for a daemon). Passwords are made here, 32 random bytes
each; a password file already there is kept (a re-run does not log every agent out), and the
server files name them in plain text: they are written owner-only.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

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


def _certificate_user(pem: str, ca: Any, role: str) -> tuple[str, list[str]]:
    """(the user a certificate maps to, the nodes it names) for `--agent-cert` (role node) or
    `--daemon-cert` (role daemon); BusError naming the file and what is wrong with it."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from kvguard.proto.channel import NODE, role_of

    option = "--agent-cert" if role == NODE else "--daemon-cert"
    try:
        cert = x509.load_pem_x509_certificate(Path(pem).read_bytes())
    except OSError as exc:
        raise BusError(f"{option} {pem}: {exc.strerror}") from None
    except ValueError as exc:
        raise BusError(f"{option} {pem}: not a PEM certificate ({exc})") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise BusError(f"{option} {pem}: not signed by the --tls-ca CA") from None
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        if ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
            hint = " (a daemon's made before: `kvguard certs issue DIR --daemon-host HOST --renew`)"
            raise BusError(f"{option} {pem}: not a client certificate{hint if role != NODE else ''}")
    except x509.ExtensionNotFound:
        pass  # no extended key usage: any use
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = x509.SubjectAlternativeName([])
    found = role_of(names.get_values_for_type(x509.UniformResourceIdentifier))
    if found != role:
        raise BusError(f"{option} {pem}: a {found}'s certificate, not a {role}'s")
    cns = [str(a.value) for a in cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]
    nodes = list(dict.fromkeys([*cns[:1], *names.get_values_for_type(x509.DNSName)]))
    return cert.subject.rfc4514_string(), nodes


def _agent_user(cluster: str, user: str, nodes: list[str], password: str | None) -> dict[str, object]:
    """An agent's user: it may speak for `nodes` only, and hear its own replies."""
    allowed: dict[str, dict[str, list[str]]] = {"publish": {"allow": []}, "subscribe": {"allow": []}}
    for node in nodes:
        for verb, rules in node_permissions(cluster, node).items():
            allowed[verb]["allow"] += [s for s in rules["allow"] if s not in allowed[verb]["allow"]]
    allowed["subscribe"]["allow"].append(f"{inbox(user)}.>")  # its replies, no one else's
    return {"user": user, **({"password": password} if password is not None else {}), "permissions": allowed}


def _users(args: argparse.Namespace, passwords: Path) -> list[dict[str, object]]:
    """The bus users: by password (`--agent`), or by certificate (`--tls-ca`)."""
    from cryptography import x509

    from kvguard.proto.channel import DAEMON, NODE

    if not args.tls_ca:
        if args.agent_cert or args.daemon_cert:
            raise BusError("--agent-cert and --daemon-cert need --tls-ca: the CA that signed them")
        agents = _agents(args.agent or [])  # a bad spec is said before any password is made
        passwords.mkdir(parents=True, exist_ok=True, mode=0o700)
        users: list[dict[str, object]] = [
            {"user": DAEMON_USER, "password": _password(passwords, DAEMON_USER)}
        ]
        for user, nodes in agents.items():
            users.append(_agent_user(args.cluster, user, nodes, _password(passwords, user)))
        return users
    if args.agent:
        raise BusError(
            "--agent USER=NODES is a password's user; with --tls-ca each agent is known by its "
            "certificate (--agent-cert)"
        )
    if not (args.tls_cert and args.tls_key):
        raise BusError("--tls-ca needs --tls-cert and --tls-key: the servers' own certificate")
    if not args.daemon_cert:
        raise BusError("--tls-ca needs at least one --daemon-cert: the daemons' certificates")
    try:
        ca = x509.load_pem_x509_certificate(Path(args.tls_ca).read_bytes())
    except OSError as exc:
        raise BusError(f"--tls-ca {args.tls_ca}: {exc.strerror}") from None
    except ValueError as exc:
        raise BusError(f"--tls-ca {args.tls_ca}: not a PEM certificate ({exc})") from None
    daemons = dict.fromkeys(_certificate_user(pem, ca, DAEMON)[0] for pem in args.daemon_cert)
    users = [{"user": user} for user in daemons]  # daemons may share a subject: they may do the same
    for pem in args.agent_cert or []:
        user, nodes = _certificate_user(pem, ca, NODE)
        users.append(_agent_user(args.cluster, user, nodes, None))
    seen = [str(u["user"]) for u in users]
    twice = sorted({u for u in seen if seen.count(u) > 1})
    if twice:
        raise BusError(
            f"two certificates of one subject ({', '.join(twice)}): the bus could not tell them apart"
        )
    return users


def server_configs(
    cluster: str,
    servers: int,
    host: str,
    port: int,
    route_port: int,
    data: Path,
    users: list[dict[str, object]],
    tls: dict[str, object] | None = None,
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
            routing: dict[str, object] = {
                "name": f"kvguard-{cluster}",
                "listen": f"{host}:{route_port + i}",
                "routes": routes,
            }
            if tls is not None and "ca_file" in tls:  # mutual TLS between the servers too
                routing["tls"] = {**{k: tls[k] for k in ("cert_file", "key_file", "ca_file")}, "verify": True}
            config["cluster"] = routing
        configs.append(json.dumps(config, indent=2) + "\n")
    return configs


def cmd_bus(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    passwords = out / "passwords"
    try:
        check_cluster(args.cluster)
        if bool(args.tls_cert) != bool(args.tls_key):
            raise BusError("--tls-cert and --tls-key go together")
        users = _users(args, passwords)
    except BusError as exc:
        print(f"kvguard bus config: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else out / "data"
    tls: dict[str, object] | None = None
    if args.tls_cert:
        tls = {"cert_file": str(Path(args.tls_cert).resolve()), "key_file": str(Path(args.tls_key).resolve())}
        if args.tls_ca:  # every client shows a certificate of the CA, and is the user it names
            tls |= {"ca_file": str(Path(args.tls_ca).resolve()), "verify_and_map": True}
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
    made = f"{len(users)} certificate user(s)" if args.tls_ca else f"{len(users)} password file(s)"
    print(f"wrote {len(configs)} server configuration(s) and {made} to {out}")
    print(f"start each:  nats-server -c {out}/server-N.conf   (or: systemctl start kvguard-nats@N)")
    if args.tls_ca:
        print(
            f"daemons:     --bus {urls} --bus-cluster {args.cluster} --bus-tls-ca {args.tls_ca} "
            "--bus-tls-cert DAEMON.pem --bus-tls-key DAEMON.key"
        )
        print(
            f"agents:      --bus {urls} --bus-cluster {args.cluster} --bus-tls-ca {args.tls_ca} "
            "--bus-tls-cert NODE.pem --bus-tls-key NODE.key"
        )
        return 0
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
        "TLS (--bus-tls-ca); without --tls-ca the routes between the servers stay plaintext: keep them on "
        "a private network",
    )
    p.add_argument("--tls-key", metavar="PEM", help="the servers' private key")
    p.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="know every client by its certificate from this CA (the kvguard CA), not by a password: "
        "the daemons by --daemon-cert, each agent by --agent-cert",
    )
    p.add_argument(
        "--daemon-cert",
        action="append",
        metavar="PEM",
        help="a daemon's certificate (`kvguard certs init`'s daemon.pem; repeatable): it may do "
        "anything on the bus",
    )
    p.add_argument(
        "--agent-cert",
        action="append",
        metavar="PEM",
        help="an agent's node certificate (`kvguard certs issue DIR --node a,b`; repeatable): it may speak "
        "for the nodes it names only",
    )
    p.add_argument(
        "--agent",
        action="append",
        metavar="USER=NODE[,NODE...]",
        help="an agent's bus user and the nodes it speaks for (repeatable)",
    )
    p.set_defaults(func=cmd_bus)
