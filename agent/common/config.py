"""The agent's settings file (``config.yaml`` in the platformdirs config folder), validated.

Every key is optional; a bad value is a :class:`ConfigError` naming the key, never a crash
halfway through start-up. Example::

    cluster_id: office-3f
    name: Alice's laptop  # what node maps call it (default: the host name)
    port: 7700          # data plane (TCP) and peer messages (UDP)
    api_port: 7701      # local status API, 127.0.0.1 only
    discovery:
      mdns: true
      static_peers: ["10.0.0.21:7700"]   # where multicast is blocked
    election:
      preferred: ["3f2a..."]             # node ids an admin pins as coordinator, best first
      exclude: ["9c1d..."]               # node ids that must never coordinate
      min_coordinator_memory_gb: 2.0
    log_level: info     # what the log file keeps (debug, info, warning, error)
    insecure: false     # true: plaintext links between nodes, logged loudly (benchmarks and tests only;
                        # without it an agent with no cluster credentials waits for 'cluster init|join')
    throttle:           # when this laptop yields to its user (see agent/throttle/settings.py)
      idle_minutes: 2
      temp_high_c: 90
    models_dir: /data/lakeshard-models   # where models are stored (default: the cache folder)
    serve:                               # how the elected coordinator serves
      model: smollm2-135m                # this laptop's override of the cluster's model (which is set
      weights: int8                      # with 'lakeshard cluster model' or Settings, for every member):
                                         # a store name, or a path to a GGUF / HF directory
      api_port: 8000                     # OpenAI-compatible API, 127.0.0.1 on the coordinator
      ring_port: 7702                    # the coordinator's ring and stage files (default: port + 2)
      streams: 4
      min_nodes: 1                       # spread the model over at least this many nodes when as many
                                         # are available (keeps each laptop's share small)
      api_rate: 0                        # requests per minute per client (0: unlimited, the default)
      api_concurrency: 0                 # requests in flight per client (0: unlimited, the default)
      attention: auto                    # how this laptop's stage attends: auto (the default: paged
                                         # where the device runs PagedAttention, CPU and GPU, else
                                         # stateful), paged (a KV block pool, many streams per infer
                                         # call) or stateful (one InferRequest per stream, the NPU's
                                         # path); LAKESHARD_ATTENTION and --attention override it
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from agent.common.paths import config_dir
from agent.throttle.policy import ThrottleSettings
from agent.throttle.settings import ThrottleSettingsError, parse_throttle, throttle_mapping

CLUSTER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    cluster_id: str = "default"
    port: int = 7700
    api_port: int = 7701
    mdns: bool = True
    static_peers: tuple[tuple[str, int], ...] = ()
    preferred: tuple[str, ...] = ()
    exclude: frozenset[str] = field(default_factory=frozenset)
    min_coordinator_memory: int = 2 * 1024**3
    interface: str | None = None  # the address to advertise (default: every interface's)
    name: str | None = None  # what node maps call this laptop (default: its host name)
    insecure: bool = False  # plaintext links between nodes (benchmarks, tests): never the default
    log_level: str = "debug"  # what the log file keeps: debug, info, warning or error
    models_dir: str | None = None  # where models are stored (default: the cache folder)
    throttle: ThrottleSettings = field(default_factory=ThrottleSettings)  # when to yield to the user
    serve_model: str | None = None
    serve_weights: str | None = None  # None: the model's default
    serve_api_port: int = 8000
    # the elected coordinator's ring and stage-file port (None: the data port + 2, e.g. 7702; 0: any)
    serve_ring_port: int | None = None
    serve_streams: int = 4
    serve_min_nodes: int = 1  # the plan uses at least this many nodes, when as many are available
    serve_exact: bool = False  # f32 activations, KV and wire (for parity checks)
    # the API's limits per client (a member laptop counts as one: see agent/api/gateway.py); its
    # API is on 127.0.0.1, reached by members through their agents, so none unless set
    serve_api_rate: int = 0
    serve_api_concurrency: int = 0
    serve_attention: str | None = None  # auto, paged or stateful (None: not set; see attention_setting)

    def with_overrides(self, **kw: Any) -> Settings:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def config_file() -> Path:
    return config_dir() / "config.yaml"


def parse_peer(v: Any, key: str = "static_peers") -> tuple[str, int]:
    if not isinstance(v, str) or ":" not in v:
        raise ConfigError(f"{key}: {v!r} is not host:port")
    host, _, port = v.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key}: {v!r} is not host:port")
    return host, int(port)


def check_cluster_id(v: Any) -> str:
    if not isinstance(v, str) or not CLUSTER_RE.match(v):
        raise ConfigError(f"cluster_id: {v!r} must be 1-64 letters, digits, '.', '_' or '-'")
    return v


def check_name(v: Any, key: str = "name") -> str:
    if not isinstance(v, str) or not v.strip() or len(v) > 64 or not v.isprintable():
        raise ConfigError(f"{key}: {v!r} must be 1-64 printable characters")
    return v.strip()


def ring_port_for(port: int) -> int:
    """The elected coordinator's ring port when ``serve.ring_port`` is not set: the data port + 2
    (7702 by default: one fixed port a firewall can open); 0 (any free port) past the range."""
    return port + 2 if 0 < port <= 65533 else 0


def _port(d: dict[str, Any], key: str, default: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
        raise ConfigError(f"{key}: {v!r} is not a port number")
    return v


def _count(d: dict[str, Any], key: str, what: str, most: int) -> int:
    v = d.get(key, 0)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= most:
        raise ConfigError(f"serve.{key}: {v!r} is not a number of {what} (0-{most}; 0: unlimited)")
    return v


def _nodes(v: Any, key: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) and NODE_RE.match(x) for x in v):
        raise ConfigError(f"{key}: must be a list of node ids")
    return tuple(v)


def _section(d: dict[str, Any], key: str) -> dict[str, Any]:
    v = d.get(key) or {}
    if not isinstance(v, dict):
        raise ConfigError(f"{key}: must be a mapping")
    return v


SERVE_KEYS = {
    "model",
    "weights",
    "api_port",
    "ring_port",
    "streams",
    "min_nodes",
    "api_rate",
    "api_concurrency",
    "attention",
}
KNOWN = {
    "cluster_id",
    "port",
    "api_port",
    "discovery",
    "election",
    "interface",
    "serve",
    "log_level",
    "models_dir",
    "name",
    "throttle",
    "insecure",
}
LOG_LEVELS = ("debug", "info", "warning", "error")
WEIGHTS = ("fp32", "fp16", "int8", "int4")
ATTENTION = ("auto", "paged", "stateful")
DEFAULT_ATTENTION = "auto"  # paged where the device runs it (agent.runtime.paged.attention_path)


def attention_setting(cli: str | None, settings: Settings, env: Mapping[str, str] = os.environ) -> str:
    """How this agent's stage attends: ``--attention``, else ``LAKESHARD_ATTENTION``, else the
    settings' ``serve.attention``, else auto. A bad environment value is a ConfigError."""
    if cli:
        return cli
    v = env.get("LAKESHARD_ATTENTION", "").strip().lower()
    if v and v not in ATTENTION:
        raise ConfigError(f"LAKESHARD_ATTENTION must be one of {', '.join(ATTENTION)}, not {v!r}")
    return v or settings.serve_attention or DEFAULT_ATTENTION


def parse(d: Any) -> Settings:
    if d is None:
        return Settings()
    if not isinstance(d, dict):
        raise ConfigError("the settings file must hold a mapping of keys")
    unknown = set(d) - KNOWN
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(map(str, unknown)))}")
    from agent.common.limits import MAX_CONCURRENCY, MAX_RATE

    disc, elec, serve = _section(d, "discovery"), _section(d, "election"), _section(d, "serve")
    unknown = set(serve) - SERVE_KEYS
    if unknown:
        raise ConfigError(f"serve: unknown setting(s): {', '.join(sorted(map(str, unknown)))}")
    model, weights, streams = serve.get("model"), serve.get("weights"), serve.get("streams", 4)
    if model is not None and (not isinstance(model, str) or not model):
        raise ConfigError("serve.model: must be a model name or a path")
    if weights is not None and weights not in WEIGHTS:
        raise ConfigError(f"serve.weights: must be one of {', '.join(WEIGHTS)}")
    if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= 256:
        raise ConfigError(f"serve.streams: {streams!r} is not a number of streams (1-256)")
    min_nodes = serve.get("min_nodes", 1)
    if isinstance(min_nodes, bool) or not isinstance(min_nodes, int) or not 1 <= min_nodes <= 256:
        raise ConfigError(f"serve.min_nodes: {min_nodes!r} is not a number of nodes (1-256)")
    mdns = disc.get("mdns", True)
    if not isinstance(mdns, bool):
        raise ConfigError("discovery.mdns: must be true or false")
    peers = disc.get("static_peers") or []
    if not isinstance(peers, list):
        raise ConfigError("discovery.static_peers: must be a list of host:port")
    mem = elec.get("min_coordinator_memory_gb", 2.0)
    if isinstance(mem, bool) or not isinstance(mem, int | float) or not 0 <= mem <= 4096:
        raise ConfigError(f"election.min_coordinator_memory_gb: {mem!r} is not a size in GB")
    iface = d.get("interface")
    if iface is not None and not isinstance(iface, str):
        raise ConfigError("interface: must be an IP address")
    try:
        throttle = parse_throttle(d.get("throttle"))
    except ThrottleSettingsError as e:
        raise ConfigError(str(e)) from None
    name = d.get("name")
    if name is not None:
        name = check_name(name)
    level = d.get("log_level", "debug")
    if level not in LOG_LEVELS:
        raise ConfigError(f"log_level: {level!r} must be one of {', '.join(LOG_LEVELS)}")
    insecure = d.get("insecure", False)
    if not isinstance(insecure, bool):
        raise ConfigError("insecure: must be true or false")
    attention = serve.get("attention")
    if attention is not None and attention not in ATTENTION:
        raise ConfigError(f"serve.attention: {attention!r} must be one of {', '.join(ATTENTION)}")
    mdir = d.get("models_dir")
    if mdir is not None and (not isinstance(mdir, str) or not mdir.strip()):
        raise ConfigError("models_dir: must be a folder path")
    return Settings(
        cluster_id=check_cluster_id(d.get("cluster_id", "default")),
        port=_port(d, "port", 7700),
        api_port=_port(d, "api_port", 7701),
        mdns=mdns,
        static_peers=tuple(parse_peer(p, "discovery.static_peers") for p in peers),
        preferred=_nodes(elec.get("preferred"), "election.preferred"),
        exclude=frozenset(_nodes(elec.get("exclude"), "election.exclude")),
        min_coordinator_memory=int(mem * 1024**3),
        interface=iface,
        name=name,
        insecure=insecure,
        throttle=throttle,
        log_level=level,
        models_dir=mdir,
        serve_model=model,
        serve_weights=weights,
        serve_api_port=_port(serve, "api_port", 8000),
        serve_ring_port=_port(serve, "ring_port", 0) if "ring_port" in serve else None,
        serve_streams=streams,
        serve_min_nodes=min_nodes,
        serve_api_rate=_count(serve, "api_rate", "requests per minute", MAX_RATE),
        serve_api_concurrency=_count(serve, "api_concurrency", "requests in flight", MAX_CONCURRENCY),
        serve_attention=attention,
    )


def to_mapping(s: Settings) -> dict[str, Any]:
    """The settings file that gives ``s``, every key written out (defaults included): ``parse``
    read back, so that what an agent runs with can be shown, and compared key by key with its file.
    Keys not set (None) are left out, as a file leaves them out."""
    d: dict[str, Any] = {
        "cluster_id": s.cluster_id,
        "name": s.name,
        "port": s.port,
        "api_port": s.api_port,
        "discovery": {"mdns": s.mdns, "static_peers": [f"{h}:{p}" for h, p in s.static_peers]},
        "election": {
            "preferred": list(s.preferred),
            "exclude": sorted(s.exclude),
            "min_coordinator_memory_gb": s.min_coordinator_memory / 1024**3,
        },
        "interface": s.interface,
        "insecure": s.insecure,
        "log_level": s.log_level,
        "models_dir": s.models_dir,
        "throttle": throttle_mapping(s.throttle),
        "serve": {
            "model": s.serve_model,
            "weights": s.serve_weights,
            "api_port": s.serve_api_port,
            "ring_port": s.serve_ring_port,
            "streams": s.serve_streams,
            "min_nodes": s.serve_min_nodes,
            "api_rate": s.serve_api_rate,
            "api_concurrency": s.serve_api_concurrency,
            "attention": s.serve_attention,
        },
    }
    return _drop_unset(d)


def _drop_unset(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _drop_unset(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


MAX_CONFIG_BYTES = 1 << 20


def load(path: Path | None = None) -> Settings:
    """The settings in ``path`` (default: the user's config file; absent means defaults)."""
    p = path or config_file()
    if not p.exists():
        if path is not None:
            raise ConfigError(f"{p}: no such settings file")
        return Settings()
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{p}: a settings file is at most {MAX_CONFIG_BYTES} bytes")
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{p}: cannot read settings: {e}") from None
    try:
        return parse(data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
