"""``lakeshard cluster init|invite|join|revoke|status``: cluster identity (see :mod:`agent.security`);
``lakeshard cluster model [NAME]``: the model the cluster serves (through the local agent's API).

The node id a certificate names is the node id of this machine's agent on the settings' data
port (``port`` in config.yaml, default 7700): the agent that will use the credentials.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agent.cli.args import Commands

# an agent without credentials polls its security folder (agent/node/unjoined.py)
WAITING_AGENT = "an agent waiting for a cluster on this machine starts as a member within a second"


def add_commands(commands: Commands) -> None:
    from agent.security import SecurityError

    commands.user_errors.append(SecurityError)
    cl = commands.add("cluster", "cluster identity: make a CA, invite and join nodes, revoke them", run_cluster)
    csub = cl.add_subparsers(dest="cluster_cmd", required=True, metavar="ACTION")
    i = csub.add_parser("init", help="make a new cluster: its CA here, and this node its first member")
    i.add_argument("--force", action="store_true", help="replace this node's credentials (every member rejoins)")
    inv = csub.add_parser("invite", help="print a join token for another node (on a node that holds the CA)")
    inv.add_argument("--expires", default="24h", help="how long the token lasts: 30m, 24h, 7d (default 24h)")
    inv.add_argument("--uses", default="1", help="how many nodes may join with it (default 1)")
    inv.add_argument(
        "--address",
        help="host:port where joiners reach this agent (default: this machine's LAN address, settings port)",
    )
    j = csub.add_parser("join", help="join the cluster a token names: this node's key pair and certificate")
    j.add_argument("token", help="the token 'lakeshard cluster invite' printed (lsj1-...)")
    j.add_argument("--force", action="store_true", help="leave the cluster this node is in for this one")
    j.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the member (default 10)")
    r = csub.add_parser("revoke", help="revoke a node: every member refuses its certificate (on a CA holder)")
    r.add_argument("node", help="its node id (12 hex digits)")
    s = csub.add_parser("status", help="this node's cluster identity: cluster id, node id, CA, expiry")
    s.add_argument("--json", action="store_true", help="print it as JSON")
    m = csub.add_parser("model", help="show the model the cluster serves, or set it for every member (NAME)")
    m.add_argument("name", nargs="?", help="the model to serve: a registry name or a model in the store")
    m.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"], help="its weights (default: the model's)")
    m.add_argument("--draft", help="speculative decoding: a draft model, 'lookup' or NAME+lookup")
    m.add_argument("--api-port", type=int, default=None, help="the local agent's status API port (default: settings)")
    m.add_argument("--json", action="store_true", help="print the agent's answer as JSON")


def _settings() -> Any:
    from agent.common.config import ConfigError, load
    from agent.security import SecurityError

    try:
        return load()
    except ConfigError as e:
        raise SecurityError(str(e)) from None


def _node() -> str:
    from agent.cluster.node_state import node_id
    from agent.common.paths import agent_state_dir

    return node_id(agent_state_dir(_settings().port))


def default_address() -> str:
    """This machine's LAN address and the settings' data port."""
    from agent.cluster.discovery import local_addresses
    from agent.security import SecurityError

    s = _settings()
    ips = local_addresses(s.interface)
    if not ips:
        raise SecurityError("this machine has no LAN address to put in the token: give --address host:port")
    host = f"[{ips[0]}]" if ":" in ips[0] else ips[0]
    return f"{host}:{s.port}"


def run_cluster(args: argparse.Namespace) -> int:
    """Every failure raises :class:`agent.security.SecurityError` (the CLI prints one line)."""
    from agent.security import cluster, tokens

    cmd = args.cluster_cmd
    if cmd == "init":
        creds = cluster.init_cluster(_node(), force=args.force)
        print(f"cluster {creds.cluster_id}: made; node {creds.node_id} holds its CA and is its first member")
        print(f"keys in {creds.folder}; add nodes with 'lakeshard cluster invite'", file=sys.stderr)
        print(WAITING_AGENT, file=sys.stderr)
    elif cmd == "invite":
        expires, uses = tokens.parse_duration(args.expires), tokens.parse_uses(args.uses)
        address = args.address or default_address()
        tokens.check_address(address)
        print(cluster.invite(address, expires, uses))
        plural = "s" if uses > 1 else ""
        print(
            f"valid for {args.expires.strip()}, {uses} use{plural}, through {address}; "
            "on the new node: lakeshard cluster join TOKEN",
            file=sys.stderr,
        )
    elif cmd == "join":
        creds = cluster.join_cluster(args.token, _node(), force=args.force, timeout=args.timeout)
        print(
            f"joined cluster {creds.cluster_id} as node {creds.node_id} "
            f"(certificate valid until {creds.expires:%Y-%m-%d})"
        )
        print(WAITING_AGENT, file=sys.stderr)
    elif cmd == "revoke":
        before = cluster.status().get("revocation_version")
        rl = cluster.revoke(args.node)
        if rl.version == before:
            print(f"node {args.node} was already revoked (revocation list version {rl.version})")
        else:
            print(f"revoked node {args.node} (revocation list version {rl.version})")
    elif cmd == "status":
        st = cluster.status()
        print(json.dumps(st, indent=2) if args.json else format_status(st))
    elif cmd == "model":
        from agent.cli.model import run_model

        return run_model(args, _settings)
    return 0


def format_status(st: dict[str, Any]) -> str:
    if not st["member"]:
        return "not in a secured cluster: 'lakeshard cluster init' makes one, 'cluster join TOKEN' joins one"
    lines = [
        f"cluster {st['cluster_id']}",
        f"node {st['node_id']}: " + ("holds the CA" if st["holds_ca"] else "member"),
        f"certificate valid until {st['cert_expires'][:10]} ({st['cert_days_left']} days)",
        f"revoked nodes: {len(st['revoked'])} (list version {st['revocation_version']})",
    ]
    if "signed_by" in st:
        lines.append(f"signed by node {st['signed_by']}")
    if st["holds_ca"]:
        lines.append(f"open invites: {st['invites_open']}, certificates issued: {st['issued']}")
    lines.append(f"keys in {st['folder']}")
    return "\n".join(lines)
