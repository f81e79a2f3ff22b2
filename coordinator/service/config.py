"""What ``lakeshard serve`` (and the elected coordinator) is asked to run, and how a model's
layers are cut into stages for a number of nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.api.events import EventHub
from agent.common.limits import TOTAL_INFLIGHT
from agent.export.exporter import ExportOptions
from agent.models.store import LocalModel
from agent.security.transport import Transport
from coordinator.api.limits import Limits
from coordinator.planning.calibration import calib_key
from coordinator.planning.planner import balanced_split, model_costs, split_from_cuts
from coordinator.service.preparing import Preparer


@dataclass
class ServeConfig:
    nodes: list[str]
    model: LocalModel
    opts: ExportOptions
    # how the coordinator's links to the agents travel, and what its data port serves (always
    # given: the daemon's, the one 'lakeshard serve' chose, PLAINTEXT for plaintext lab clusters)
    transport: Transport = field(kw_only=True)
    split: list[int] | None = None
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_port_fix: str = "give this one another --api-port"  # what to do when the API port is taken
    api_key: str | None = None
    # request limits per client (see coordinator/api/limits.py; the CLI resolves its defaults)
    api_limits: Limits = field(default_factory=lambda: Limits(total=TOTAL_INFLIGHT))
    data_host: str = "127.0.0.1"
    data_port: int = 0  # the ring's return and stage files (0: any free port)
    data_port_fallback: bool = False  # data_port taken: any free port instead (with a warning)
    advertise_host: str | None = None
    max_streams: int = 4  # streams in flight at once, one step each (stateful stages)
    batching: bool = True  # paged stages: continuous batching (micro-batches of many streams)
    batch_streams: int = 64  # streams a batching ring runs at once (more wait for their turn)
    prefix_cache: bool = True  # batching: finished prompts' KV heads stay for requests that share them
    batch_queue: int = 64  # requests waiting for their turn before the API answers 503 (Retry-After)
    link_delay_ms: float = 0.0
    link_mbps: float = 0.0
    wire_dtype: str = "f16"
    exact: bool = False
    term: int = 1
    quiet: bool = False
    api: bool = True  # False: the pipeline and scheduler only (benchmarks)
    ship_artifacts: bool = False
    draft: str | None = None  # speculative decoding: a draft model (name or path) or "lookup"
    draft_weights: str = "int4"
    draft_threads: int | None = None
    spec_k: int | None = None  # fixed draft length; None: chosen at run time
    spec_depth: int | None = None  # verify frames in flight per stream (2 = draft ahead); None: chosen at run time
    failover: bool = True  # re-plan over the surviving agents when one is lost, and resume
    ring_loop: bool = True  # plain decoding: the last stage feeds stage 0 itself (Fwd.auto)
    rebalance: bool = False  # re-plan once from measured stage times (see Coordinator.async_rebalance)
    # this machine's own agent (host:port), where it serves a stage: when that is the first
    # stage, the coordinator reaches it without crossing the network (no emulated WAN delay)
    home: str | None = None
    # the cluster event stream (None: one of its own, showing the pipeline's agents)
    events: EventHub | None = None
    cluster_id: str = "default"
    preparing: Preparer | None = None  # where its steps are told (None: one of its own, on its hub)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def calib_key(self) -> str:
        """Under which key the measured head cost of this model and these weights is stored."""
        return calib_key(self.model.name, self.opts.weights)


def plan_ranges(
    model: LocalModel, n_stages: int, split: Sequence[int] | None, head_layers: float | None = None
) -> list[tuple[int, int]]:
    """The layer ranges of ``n_stages`` stages: cut at ``split`` when given, else balanced by cost
    (``head_layers``: what the output head costs, in layers, as measured; None: estimated)."""
    if split:
        ranges = split_from_cuts(model.num_layers, split)
        if len(ranges) != n_stages:
            raise ValueError(f"--split gives {len(ranges)} stages for {n_stages} nodes")
        return ranges
    return balanced_split(model_costs(model.config(), head_layers), n_stages)
