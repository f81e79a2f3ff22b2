"""Stage artifacts travel over HTTP to agents that do not share the coordinator's disk, are
verified, cached by hash; an assignment with a bad hash is refused and the agent keeps serving."""

from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.request
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from agent.protocol import Assign, Assigned, Error, Message, ProtocolError, decode, encode
from agent.runtime.device import available_devices
from tests.support.prompts import PROMPTS
from tests.support.served import Served, chat


def test_agents_download_verify_and_cache_their_stage(smollm2, tmp_path: Path, whole_int8, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    home = tmp_path / "agents-home"
    served = Served(
        2,
        "--model",
        "smollm2-135m",
        "--weights",
        "int8",
        "--exact",
        "--ship-artifacts",
        agent_env={"LAKESHARD_HOME": str(home)},
    )
    try:
        text = chat(served, PROMPTS[0], max_tokens=32, temperature=0)
        ids = smollm2_tokenizer.chat_ids([{"role": "user", "content": PROMPTS[0]}])
        ref = smollm2_tokenizer.decode(
            whole_int8.generate(ids, max_tokens=32, stop_ids=smollm2_tokenizer.stop_ids).tokens
        )
        assert text == ref
        cached = sorted((home / "cache" / "artifacts").iterdir())
        assert len(cached) == 2  # one directory per stage, named by the manifest's hash
        for d in cached:
            man = json.loads((d / "manifest.json").read_text())
            assert hashlib.sha256((d / "manifest.json").read_bytes()).hexdigest().startswith(d.name)
            for name, info in man["files"].items():
                assert hashlib.sha256((d / name).read_bytes()).hexdigest() == info["sha256"]

        async def assign(msg: Assign) -> Message:
            async with aiohttp.ClientSession() as s, s.ws_connect(f"http://{served.nodes[0]}/ws") as ws:
                await ws.send_bytes(encode(msg))
                reply, _ = decode((await asyncio.wait_for(ws.receive(), 120)).data)
                return reply

        bad = Assign(
            term=50,  # a newer term, but bad files: refused, and the term is not taken
            export_id="x",
            stage=0,
            stages=2,
            manifest_sha256="0" * 64,
            artifacts_url="http://127.0.0.1:9/nothing",
            local_dir=None,
            next_hop="ws://127.0.0.1:9/ws",
        )
        err = asyncio.run(assign(bad))
        assert isinstance(err, Error) and err.code == "bad_artifact"
        # a device this machine lacks (these agents run on AUTO): one clear line naming the devices seen
        stage0 = next(d for d in cached if json.loads((d / "manifest.json").read_text())["stage"]["index"] == 0)
        here = Assign(
            term=51,
            export_id="x",
            stage=0,
            stages=2,
            manifest_sha256=hashlib.sha256((stage0 / "manifest.json").read_bytes()).hexdigest(),
            artifacts_url="http://127.0.0.1:9/nothing",
            local_dir=str(stage0),
            next_hop=f"ws://{served.nodes[1]}/ws",
            wire_dtype="f32",
            exact=True,
        )
        seen = available_devices()
        if not any(d.startswith("GPU") for d in seen):
            err = asyncio.run(assign(replace(here, device="GPU")))
            assert isinstance(err, Error) and err.code == "bad_device"
            assert "'GPU' is not available" in err.message and err.message.endswith(", ".join(seen))
            assert "\n" not in err.message
        with urllib.request.urlopen(f"http://{served.nodes[0]}/v1/node", timeout=10) as r:
            assert json.loads(r.read())["stage"]["term_seen"] == 1
        # the agent kept its stage: the pipeline still answers, identically
        assert chat(served, PROMPTS[0], max_tokens=32, temperature=0) == text
        # the planner's device, named in the assignment, is the one the stage compiles on
        ok = asyncio.run(assign(replace(here, device="CPU")))
        assert isinstance(ok, Assigned) and ok.device == "CPU" and ok.term == 51 and ok.stage == 0
        with urllib.request.urlopen(f"http://{served.nodes[0]}/v1/node", timeout=10) as r:
            stage = json.loads(r.read())["stage"]
        assert stage["term_seen"] == 51 and stage["device"] == "CPU"
    finally:
        served.stop()


async def test_an_interrupted_download_resumes_where_it_stopped(tmp_path: Path) -> None:
    """The agent asks only for the missing bytes (HTTP Range) and reports its progress."""
    from aiohttp import web

    from agent.security.transport import PLAINTEXT
    from agent.serving.stage_files import StageFiles

    blob = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "model.bin").write_bytes(blob)
    ranges: list[str | None] = []

    async def serve(request: web.Request) -> web.StreamResponse:
        ranges.append(request.headers.get("Range"))
        return web.FileResponse(tmp_path / "model.bin")

    app = web.Application()
    app.router.add_get("/model.bin", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    files = StageFiles(transport=PLAINTEXT)
    part = tmp_path / "partial.bin"
    part.write_bytes(blob[:300_000])  # what arrived before the link dropped
    try:
        async with aiohttp.ClientSession() as s:
            await files.async_fetch(s, f"http://127.0.0.1:{port}/model.bin", part, 0.0, len(blob))
            assert part.read_bytes() == blob
            assert ranges == ["bytes=300000-"]
            assert files.fetching == {
                "file": "partial.bin",
                "bytes": len(blob),
                "total": len(blob),
                "resumed_from": 300_000,
            }
            await files.async_fetch(
                s, f"http://127.0.0.1:{port}/model.bin", part, 0.0, len(blob)
            )  # whole: nothing more
            assert part.read_bytes() == blob
            # a server that sends more than the manifest declared is refused, and the file goes
            big = tmp_path / "big.bin"
            with pytest.raises(ProtocolError, match="more than the 1000 bytes expected"):
                await files.async_fetch(s, f"http://127.0.0.1:{port}/model.bin", big, 0.0, 1000)
            assert not big.exists()
    finally:
        await runner.cleanup()
