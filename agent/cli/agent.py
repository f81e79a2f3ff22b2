"""``lakeshard agent`` (the daemon) and ``lakeshard status`` (a table of what the local agent sees)."""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.cli.args import Commands, port, positive_int
from agent.protocol.codec import ProtocolError
from agent.protocol.status import ClusterStatus, NodeStatus

if TYPE_CHECKING:
    from agent.protocol.cluster_view import Preparation


class AgentCliError(Exception):
    pass


def add_commands(commands: Commands) -> None:
    commands.user_errors.append(AgentCliError)
    ag = commands.add("agent", "run this machine's agent: discovery, election, and a pipeline stage", run_agent)
    ag.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    ag.add_argument("--port", type=port, help="data port, TCP and UDP (default: settings, else 7700)")
    ag.add_argument("--api-port", type=port, help="local status API port on 127.0.0.1 (default 7701; 0: any)")
    ag.add_argument("--config", type=Path, help="settings file (default: config.yaml in the config folder)")
    ag.add_argument("--cluster", help="cluster id (default: settings, else 'default')")
    ag.add_argument("--name", help="what node maps call this laptop (default: settings, else the host name)")
    ag.add_argument("--static-peers", help="host:port,... to reach where multicast is blocked")
    ag.add_argument("--no-mdns", action="store_true", help="do not use multicast DNS (static peers only)")
    ag.add_argument("--interface", help="the IP address to advertise and to be reached on (default: all)")
    ag.add_argument(
        "--standalone", action="store_true", help="no discovery or election: serve the stage a 'serve' command assigns"
    )
    ag.add_argument("--serve-model", help="serve this model when elected (overrides the cluster's model)")
    ag.add_argument("--serve-weights", choices=["fp32", "fp16", "int8", "int4"], help="its weight format")
    ag.add_argument("--serve-api-port", type=port, help="the coordinator's API port on 127.0.0.1 (8000)")
    ag.add_argument(
        "--serve-ring-port", type=port, help="the coordinator's ring and stage-file port (data port + 2; 0: any)"
    )
    ag.add_argument("--serve-exact", action="store_true", help="f32 activations, KV and wire (parity checks)")
    ag.add_argument("--device", default="AUTO", help="AUTO (GPU if present, else CPU), CPU, GPU or NPU")
    ag.add_argument("--threads", type=positive_int, help="CPU inference threads")
    ag.add_argument(
        "--spin-ms", type=float, default=50.0, help="keep the core busy this long after a step while streams run"
    )
    ag.add_argument(
        "--head-help",
        choices=["auto", "on", "off"],
        default="auto",
        help="as the last stage, let stage 0 compute part of the vocabulary head for a lone stream: "
        "while it measurably pays (auto), always (on) or never (off)",
    )
    ag.add_argument(
        "--attention",
        choices=["auto", "paged", "stateful"],
        help="how this agent's stage attends: auto (paged where the device runs it: CPU, GPU), paged "
        "(PagedAttention over a KV block pool: many streams in one inference) or stateful (one inference per "
        "stream); default: LAKESHARD_ATTENTION, else serve.attention in the settings, else auto",
    )
    ag.add_argument(
        "--throttle",
        choices=["on", "off"],
        default="on",
        help="yield to this laptop's user, heat and battery as the settings' throttle section says (on), "
        "or never (off: local test clusters, where the other agents would count as the user's programs)",
    )
    ag.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext links between nodes (benchmarks, tests; also 'insecure: true' in the settings); logged "
        "loudly. Without it an agent never speaks plaintext: with no cluster credentials it waits for "
        "'lakeshard cluster init' or 'cluster join' (its status API only)",
    )
    st = commands.add(
        "status", "show this node, its peers and the coordinator, as the local agent sees them", run_status
    )
    st.add_argument("--api-port", type=port, default=None, help="the local agent's status API port")
    st.add_argument("--json", action="store_true", help="print the raw JSON of /v1/node and /v1/cluster")
    st.add_argument(
        "--watch", action="store_true", help="follow the coordinator's event stream: a line per change, until ^C"
    )


def run_agent(args: argparse.Namespace) -> int:
    from agent.common.config import ConfigError, attention_setting, check_cluster_id, check_name, load, parse_peer

    try:
        settings = load(args.config)
        peers = None
        if args.static_peers:
            peers = tuple(parse_peer(p.strip(), "--static-peers") for p in args.static_peers.split(",") if p.strip())
        settings = settings.with_overrides(
            port=args.port,
            api_port=args.api_port,
            cluster_id=check_cluster_id(args.cluster) if args.cluster else None,
            name=check_name(args.name, "--name") if args.name is not None else None,
            static_peers=peers,
            mdns=False if args.no_mdns else None,
            interface=args.interface,
            serve_model=args.serve_model,
            serve_weights=args.serve_weights,
            serve_api_port=args.serve_api_port,
            serve_ring_port=args.serve_ring_port,
            serve_exact=True if args.serve_exact else None,
        )
        attention = attention_setting(args.attention, settings)
    except ConfigError as e:
        raise AgentCliError(str(e)) from None
    from agent.common.logs import set_file_level
    from agent.node.daemon import DaemonOptions

    set_file_level(settings.log_level)
    from agent.cluster.node_state import StateError
    from agent.runtime.device import choose_device
    from agent.security.errors import SecurityError

    choose_device(args.device)
    opts = DaemonOptions(
        host=args.host,
        device=args.device,
        threads=args.threads,
        spin_ms=max(0.0, args.spin_ms),
        head_help=args.head_help,
        attention=attention,
        standalone=args.standalone,
        throttle=args.throttle != "off",
        insecure=args.insecure or settings.insecure,
    )
    from agent.node.unjoined import run_agent as run_local_agent

    try:
        run_local_agent(settings, opts, args.config)
    except (StateError, OSError, SecurityError) as e:
        raise AgentCliError(str(e)) from None
    return 0


def _get(port: int, path: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            data: dict[str, Any] = json.loads(r.read())
            return data
    except (urllib.error.URLError, OSError) as e:
        raise AgentCliError(f"no agent answers on 127.0.0.1:{port} ({e}); start one with 'lakeshard agent'") from None


def _gb(v: Any) -> str:
    return "-" if v is None else f"{v / 1024**3:.1f} GB"


def run_status(args: argparse.Namespace) -> int:
    port = args.api_port
    if port is None:
        from agent.common.config import ConfigError, load

        try:
            port = load().api_port
        except ConfigError as e:
            raise AgentCliError(str(e)) from None
    node, cluster = _get(port, "/v1/node"), _get(port, "/v1/cluster")
    if args.watch:
        return watch(port, as_json=args.json)
    if args.json:
        print(json.dumps({"node": node, "cluster": cluster}, indent=2))
        return 0
    try:
        print(format_status(NodeStatus.parse(node), ClusterStatus.parse(cluster)))
    except ProtocolError as e:
        raise AgentCliError(f"the agent's status does not read ({e}); is it another version of lakeshard?") from None
    return 0


def format_status(node: NodeStatus, cluster: ClusterStatus) -> str:
    """``lakeshard status`` in words: this node's line, then a table of it and its peers."""
    if node.state == "no_cluster":
        return f"node {node.node}: {node.hint or 'not in a cluster'}" + (
            f"\nlast start as a member failed: {node.error}" if node.error else ""
        )
    coord = cluster.coordinator or "none (election in progress)"
    lines = [
        f"node {node.node} in cluster {node.cluster}: {node.role}, {node.state}; "
        f"term {cluster.term}, coordinator {coord}",
    ]
    if node.role == "standalone":
        lines.append("standalone: no discovery or election")
    traffic = cluster.details.get("election_traffic") or {}
    if node.links:
        signed = {"signed": ", election datagrams signed", "plaintext": ", election datagrams unsigned"}
        lines.append(f"links to other nodes: {node.links}" + signed.get(traffic.get("mode", ""), ""))
    why = cluster.not_eligible_because
    if why:
        lines.append(f"this node does not stand for coordinator: {why}")
    m = cluster.details.get("model")
    if m:  # what it serves when elected: its override, else the cluster's model setting
        lines.append(f"serves when elected: {m['model']}: {m['why']}" if m.get("model") else f"serves: {m['why']}")
    head = ("NODE", "ADDRESS", "ROLE", "TERM", "STATE", "STANDS", "SPEED", "FREE MEM", "DEVICES", "HEARD")
    rows = [
        (
            f"{node.node} (this)",
            f"*:{node.port}",
            node.role,
            str(cluster.term),
            node.state + (f" ({node.reason})" if node.reason else ""),
            "yes" if cluster.eligible else "no",
            f"{node.speed_score:.0f}",
            _gb(node.mem_free),
            ",".join(node.devices),
            "-",
        )
    ]
    for p in cluster.peers:
        heard = p.last_heard_s
        rows.append(
            (
                p.node,
                p.address,
                (p.role or "?") if p.alive else "gone",
                str(p.term if p.term is not None else "-"),
                (p.state or "-") + (f" ({p.reason})" if p.reason else ""),
                {True: "yes", False: "no", None: "-"}[p.eligible],
                "-" if p.score is None else f"{p.score:.0f}",
                _gb(p.mem_free),
                ",".join(p.devices) or "-",
                "never" if heard is None else f"{heard:.1f}s ago",
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    sv = cluster.details.get("services")
    if sv:
        api = ""
        if sv["api"]:
            api = f", API {sv['api']}" + (f" (limits: {sv['api_limits']})" if sv.get("api_limits") else "")
        model = f" {sv['model']}" if sv["model"] else ""  # (none yet: "no model", not "no model None")
        lines.append(f"coordinator services: {sv['state']}{model}{api}")
        if sv.get("preparing"):
            lines.append(f"  preparing: {sv['preparing']}")
        for i, st in enumerate(sv["plan"]):
            a, b = st["layers"]
            lines.append(f"  stage {i}: layers {a}..{b - 1} on {st['node']} ({st['address']})")
        if sv["error"]:
            lines.append(f"  error: {sv['error']}")
        for r in sv["recoveries"]:
            lines.append(f"  recovered from losing {r['lost']} in {r['seconds']}s (term {r['term']})")
    hist = cluster.details.get("history") or []
    if hist:
        last = hist[-1]
        lines.append(f"coordinator since {time.strftime('%H:%M:%S', time.localtime(last['at']))} (term {last['term']})")
    return "\n".join(lines)


def watch(port: int, as_json: bool = False) -> int:
    """``status --watch``: the cluster event stream (through the local agent), one line an event."""
    import asyncio

    import aiohttp

    from agent.protocol.cluster_view import MAX_EVENT_BYTES
    from agent.protocol.codec import ProtocolError
    from agent.protocol.events import Preparing, Snapshot, apply_event, parse_event

    steps = PrepLines()

    async def follow() -> None:
        view = None
        url = f"http://127.0.0.1:{port}/v1/cluster/events"
        async with aiohttp.ClientSession() as s, s.ws_connect(url, max_msg_size=MAX_EVENT_BYTES) as ws:
            async for m in ws:
                if m.type != aiohttp.WSMsgType.TEXT:
                    break
                if as_json:
                    print(m.data, flush=True)
                    continue
                try:
                    ev = parse_event(m.data)
                except ProtocolError as e:
                    print(f"(an event that does not parse: {e})", flush=True)
                    continue
                view = apply_event(view, ev)
                if isinstance(ev, Preparing) and not steps.news(ev.preparing, time.monotonic()):
                    continue  # (a percent update too soon after the last one printed)
                print(event_line(ev), flush=True)
                if isinstance(ev, Snapshot) and ev.view.preparing is not None:
                    steps.news(ev.view.preparing, time.monotonic())
                    print(event_line(Preparing(ev.at, ev.view.preparing)), flush=True)

    try:
        asyncio.run(follow())
    except (aiohttp.ClientError, OSError) as e:
        raise AgentCliError(f"no agent answers on 127.0.0.1:{port} ({e}); start one with 'lakeshard agent'") from None
    except KeyboardInterrupt:
        return 130
    return 0


def event_line(ev: Any) -> str:
    """One event as a line of ``status --watch`` (pure)."""
    from agent.protocol import events as E

    t = time.strftime("%H:%M:%S", time.localtime(ev.at))
    if isinstance(ev, E.Snapshot):
        v = ev.view
        stages = " -> ".join(f"{n}" for n in v.ring) or "no stages"
        return (
            f"{t} snapshot: cluster {v.cluster}, coordinator {v.coordinator or 'none'} (term {v.term}), "
            f"{len(v.nodes)} node(s), {v.model or 'no model'} {v.service}: {stages}"
        )
    if isinstance(ev, E.NodeJoined | E.NodeChanged):
        n = ev.node
        what = "joined" if isinstance(ev, E.NodeJoined) else "changed " + ",".join(ev.changed)
        layers = f" layers {n.layers[0]}..{n.layers[1] - 1}" if n.layers else ""
        why = f" ({n.reason})" if n.reason else ""
        return f"{t} node {n.node} ({n.name}) {what}: {n.role}, {n.state}{why}{layers}, {n.tok_s:.0f} tok/s"
    if isinstance(ev, E.NodeLeft):
        return f"{t} node {ev.node} ({ev.name}) left"
    if isinstance(ev, E.PlanChanged):
        ring = ", ".join(f"{n} {a}..{b - 1}" for n, (a, b) in zip(ev.ring, ev.layers, strict=True))
        return f"{t} plan {ev.service} (term {ev.term}): {ring or 'no stages'}"
    if isinstance(ev, E.Failover):
        return f"{t} failover: lost {ev.lost}, resumed in {ev.seconds:.1f} s (term {ev.term})"
    if isinstance(ev, E.Takeover):
        again = "exported again" if ev.exported else "nothing exported again"
        return (
            f"{t} takeover by {ev.coordinator} in {ev.seconds:.1f} s (term {ev.term}): "
            f"{ev.kept} stage(s) kept, {ev.moved} moved, {again}"
        )
    if isinstance(ev, E.Preparing):
        p = ev.preparing
        if p is None:
            return f"{t} preparing: nothing"
        nodes = ""
        if p.step in ("sending", "compiling") and len(p.nodes) > 1:
            nodes = "; " + ", ".join(f"{n.node} {n.describe()}" for n in p.nodes)
        return f"{t} preparing {p.model}: {p.describe()}{nodes}"
    if isinstance(ev, E.CoordinatorLost):
        return f"{t} coordinator {ev.coordinator or '?'} lost; waiting for the next"
    if isinstance(ev, E.StreamStarted):
        return f"{t} stream {ev.stream} started: {ev.prompt_tokens} prompt tokens"
    if isinstance(ev, E.StreamFinished):
        rate = f", {ev.tok_s:.1f} tok/s" if ev.tok_s else ""
        return f"{t} stream {ev.stream} {ev.outcome}: {ev.tokens} tokens{rate} on {', '.join(ev.nodes)}"
    return f"{t} {ev.TYPE}"


class PrepLines:
    """Which preparation updates ``status --watch`` prints: every new step (a step, a stage, a
    node's step) once; the same step's percent only after ``every_s`` or ``points`` more."""

    def __init__(self, every_s: float = 5.0, points: float = 10.0) -> None:
        self.every_s, self.points = every_s, points
        self.last: Preparation | None = None  # the step last printed
        self.at = 0.0

    def news(self, p: Preparation | None, now: float) -> bool:
        """Whether ``p`` (None: nothing prepared) is worth a line at ``now`` (monotonic seconds)."""
        last = self.last
        if p is None or last is None or p.steps() != last.steps():
            fresh = not (p is None and last is None)
        else:
            moved = p.percent is not None and abs(p.percent - (last.percent or 0.0)) >= self.points
            fresh = p.percent != last.percent and (moved or now - self.at >= self.every_s)
        if fresh:
            self.last, self.at = p, now
        return fresh
