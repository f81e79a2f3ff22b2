"""Websocket heartbeats: a dead agent is found within seconds, yet a live one busy setting up its
stage (a slow download, a cold compile) is never taken for dead."""

from __future__ import annotations

import time
from pathlib import Path

from agent.common import paths
from tests.support.served import Served, chat

HEARTBEAT_S = "1.5"  # a ping after 1.5 s of silence; no pong within 0.75 s closes the connection


def test_agents_busy_downloading_their_stage_for_longer_than_the_heartbeat_still_join(
    smollm2,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    # Each agent downloads its ~45 MB stage over an emulated 80 Mbit/s line (about 4.5 s, far past
    # the 2.25 s in which a connection that answers no ping is closed), then compiles it cold.
    agent_env = {
        "LAKESHARD_HEARTBEAT_S": HEARTBEAT_S,
        "LAKESHARD_HOME": str(tmp_path / "agents"),
        "LAKESHARD_SHARED_CACHE": str(paths.cache_dir()),
    }
    t0 = time.monotonic()
    served = Served(
        2,
        "--model",
        "smollm2-135m",
        "--weights",
        "int4",
        "--ship-artifacts",
        "--link-mbps",
        "80",
        agent_env=agent_env,
        env={"LAKESHARD_HEARTBEAT_S": HEARTBEAT_S},
    )
    try:
        assert time.monotonic() - t0 > 2 * 4.0  # both downloads really were that slow
        assert len(list((tmp_path / "agents" / "cache" / "artifacts").iterdir())) == 2
        assert chat(served, "Name a colour.", max_tokens=8, temperature=0).strip()
        assert not any("gone" in line for line in served.output), "".join(served.output[-20:])
    finally:
        served.stop()
