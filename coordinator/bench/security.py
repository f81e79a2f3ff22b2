"""``lakeshard bench security``: what mutual TLS costs, and what hostile peers get (issue 26).

In one run, on throwaway credentials (a cluster CA, node certificates and an outsider cluster in
a temporary folder; the user's own home is never touched):

* the same 2-stage pipeline over mutual TLS and over plaintext (``--insecure``), two clusters
  side by side on the same cores, runs alternating: ``tls_ratio`` is the median of the pairs'
  tok/s ratios (secure / plaintext), half the pairs with the TLS coordinator started first and
  half with the plaintext one (``tls_ratio_by_start``: the first-started one runs slower here);
* ``--fuzz`` hostile frames (:mod:`coordinator.lab.fuzz_frames`) sent to both stages of the plaintext
  ring on connections of their own, while a greedy stream runs through it: every frame must be
  answered within seconds (no hang), the agents must live, and every healthy run must give the
  tokens of an undisturbed one; many frames name the live stream's id;
* hostile connections to the secure cluster (no certificate, another cluster's, a revoked one,
  plaintext to a TLS port, a forged loop link) and to the plaintext one (oversized frames,
  unknown streams): ``hostile_accepted`` counts those that got what they asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from agent.cluster.node_state import node_id
from agent.common import aio, paths
from agent.export.exporter import ExportOptions
from agent.protocol import MAX_FRAME, Close, Fwd, encode
from agent.security import cluster, files, join, pki, tokens, transport
from agent.security.credentials import Credentials
from agent.serving.owners import LINK_HEADER
from coordinator.bench.pipeline import BenchError, resolve_model
from coordinator.lab.fuzz_frames import VICTIM_MARK, hostile_frames
from coordinator.lab.live_fuzz import Hostile, generate, healthy, name_streams
from coordinator.lab.local_cluster import LocalCluster, free_port
from coordinator.lab.machine_load import SHARED, OthersWindow, others_share
from coordinator.service.config import ServeConfig
from coordinator.service.coordinator import Coordinator


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextmanager
def _home(home: Path) -> Iterator[None]:
    old = os.environ.get("LAKESHARD_HOME")
    os.environ["LAKESHARD_HOME"] = str(home)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LAKESHARD_HOME", None)
        else:
            os.environ["LAKESHARD_HOME"] = old


def member(ca_dir: Path, folder: Path, node: str) -> Credentials:
    """``node`` joins the CA in ``ca_dir`` through the CA holder's own answer to the join protocol."""
    ca = Credentials.load(ca_dir)
    tok = tokens.parse_token(cluster.invite("127.0.0.1:1", 60, 1, ca_dir))
    key = pki.new_key()
    csr = pki.make_csr(key, node)
    nonce = os.urandom(16)
    proof = tokens.proof(tok.key, tok.token_id, pki.csr_der(csr), nonce)
    body = {"token": tok.token_id, "csr": pki.csr_pem(csr).decode(), "nonce": nonce.hex(), "proof": proof.hex()}
    ans = join.answer_join(ca, json.dumps(body).encode())
    files.write_private(folder / files.NODE_KEY, pki.key_pem(key))
    files.write_public(folder / files.CA_CERT, ans["ca"].encode())
    files.write_json(folder / files.REVOKED, ans["revoked"])
    files.write_public(folder / files.NODE_CERT, ans["cert"].encode())
    return Credentials.load(folder)


class Pki:
    """A cluster for two agents on ``ports`` and this process, plus a spare member and an outsider."""

    def __init__(self, root: Path, ports: list[int]) -> None:
        self.homes = [root / f"agent{i}" for i in range(len(ports))]
        ids = []
        for home, port in zip(self.homes, ports, strict=True):
            with _home(home):
                ids.append(node_id(paths.agent_state_dir(port)))
        self.ca_dir = files.security_dir(self.homes[0] / "config" / "security")
        cluster.init_cluster(ids[0], self.ca_dir)
        for home, nid in zip(self.homes[1:], ids[1:], strict=True):
            member(self.ca_dir, files.security_dir(home / "config" / "security"), nid)
        self.coordinator = member(self.ca_dir, files.security_dir(root / "coordinator"), "c0c0c0c0c0c0")
        self.spare = member(self.ca_dir, files.security_dir(root / "spare"), "5a5a5a5a5a5a")
        self.outsider = cluster.init_cluster("0b0b0b0b0b0b", files.security_dir(root / "outsider"))

    def envs(self) -> list[dict[str, str]]:
        shared = os.environ.get("LAKESHARD_SHARED_CACHE") or str(paths.cache_dir())
        return [{"LAKESHARD_HOME": str(h), "LAKESHARD_SHARED_CACHE": shared} for h in self.homes]


async def _start(cfg: ServeConfig) -> Coordinator:
    coord = Coordinator(cfg)
    await coord.async_start()
    return coord


async def _tls_pairs(
    coords: dict[str, Coordinator], prompt: list[int], tokens_: int, runs: int, pids: list[int]
) -> dict[str, Any]:
    """Alternating timed runs, and what other processes (not ``pids``) used of the CPU meanwhile."""
    for c in coords.values():
        await generate(c, prompt, 4)  # warm-up
    window = OthersWindow(pids)
    speeds: dict[str, list[float]] = {"tls": [], "plain": []}
    texts: dict[str, list[int]] = {}
    loop = asyncio.get_running_loop()
    for r in range(runs):
        order = ["tls", "plain"] if r % 2 == 0 else ["plain", "tls"]
        for name in order:
            await asyncio.sleep(0.2)  # the other cluster's stages stop spinning
            t0 = loop.time()
            got = await generate(coords[name], prompt, tokens_)
            speeds[name].append(len(got) / (loop.time() - t0))
            texts[name] = got
    _say(f"tok/s over mTLS {[round(x, 2) for x in speeds['tls']]}, plaintext {[round(x, 2) for x in speeds['plain']]}")
    return {"tls": speeds["tls"], "plain": speeds["plain"], "texts": texts, "others": window.close()}


def _pooled(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One figure from the pairs measured with the TLS coordinator started first and those with
    the plaintext one started first: the median of all pairs' ratios."""
    halves = (first, second) if second is not first else (first,)
    tls = [x for h in halves for x in h["tls"]]
    plain = [x for h in halves for x in h["plain"]]
    ratios = [a / b for a, b in zip(tls, plain, strict=True)]
    share = others_share([h["others"] for h in halves])
    if share is not None and share > SHARED:
        _say(f"other processes used {share:.0%} of the CPU during the timed runs: these ratios are of a shared machine")
    return {
        "tls_tok_s": round(statistics.median(tls), 2),
        "plain_tok_s": round(statistics.median(plain), 2),
        "tls_ratio": round(statistics.median(ratios), 3),
        "tls_ratio_by_start": [
            round(statistics.median(a / b for a, b in zip(h["tls"], h["plain"], strict=True)), 3) for h in halves
        ],
        "tls_same_tokens": all(h["texts"]["tls"] == h["texts"]["plain"] == first["texts"]["tls"] for h in halves),
        "others_cpu_share": None if share is None else round(share, 3),
    }


async def _refused(url: str, ctx: Any, headers: dict[str, str] | None = None) -> bool:
    """Whether a websocket to ``url`` (with client SSL ``ctx``: an SSLContext, or False: none) is refused."""
    try:
        conn = aiohttp.TCPConnector(ssl=ctx)
        timeout = aiohttp.ClientTimeout(total=20)
        async with (
            aiohttp.ClientSession(connector=conn, timeout=timeout) as s,
            s.ws_connect(url, headers=headers or {}) as ws,
        ):
            await ws.close()
            return False
    except (aiohttp.ClientError, OSError, TimeoutError):
        return True


async def _answered(
    node: str, frame: bytes, headers: dict[str, str] | None = None, linger: float = 0.0
) -> dict[str, int]:
    """The error codes an agent answers ``frame`` with, on a connection of its own (a Ping after it
    tells when everything is answered; a hang raises TimeoutError)."""
    h = Hostile([f"ws://{node}/ws"], headers=headers)
    async with h:
        await h.send(frame, linger=linger)
    if h.tally.hangs:
        raise TimeoutError(f"the agent at {node} did not answer")
    return h.tally.codes


async def _plain_attacks(plain: list[str], coord: Coordinator, prompt: list[int]) -> list[tuple[str, bool]]:
    """Against the plaintext ring, while a stream runs through it: (what, whether it was refused)."""
    tried: list[tuple[str, bool]] = []
    assert coord.pipeline is not None
    seen = coord.pipeline.new_stream
    ids: list[str] = []
    coord.pipeline.new_stream = lambda: ids.append(seen()) or ids[-1]  # type: ignore[method-assign,func-returns-value]
    running = asyncio.create_task(generate(coord, prompt, 400))
    while not ids:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    victim = ids[-1]
    term = coord.cfg.term  # the live coordinator's own term: only the connection is wrong
    one = np.ones((1, 1), np.int32)
    for node in plain:  # while the stream runs: refused at once, on the event loop
        for f, hdr in [
            (Fwd(term=term, stream=victim, seq=0, n=1, dtype="i32", start=True), None),
            (Fwd(term=term, stream=victim, seq=50, n=1, dtype="i32"), None),
            (Fwd(term=term, stream=victim, seq=50, n=1, dtype="i32", auto=1), {LINK_HEADER: "loop"}),
        ]:
            codes = await _answered(node, encode(f, one), hdr)
            what = "restart" if f.start else "continue"
            tried.append((f"{what} the live stream{' as a forged loop link' if hdr else ''}", "not_owner" in codes))
        codes = await _answered(node, encode(Close(term=term, stream=victim)))
        tried.append(("close the live stream", "not_owner" in codes))
    if running.done():
        raise BenchError("the live stream ended before every attempt on it was made")
    await running
    for node in plain:
        frame = encode(Fwd(term=term, stream="nobody", seq=3, n=1, dtype="i32"), one)
        codes = await _answered(node, frame, linger=2.0)  # refused on the compute thread
        tried.append(("a step of an unknown stream", bool(codes)))
        async with aiohttp.ClientSession() as s, s.ws_connect(f"ws://{node}/ws", max_msg_size=0) as ws:
            try:  # a frame over the limit: the connection is closed
                await ws.send_bytes(b"\0" * (MAX_FRAME + 1))
                m = await asyncio.wait_for(ws.receive(), 60)
                tried.append(("a frame over the size limit", m.type != aiohttp.WSMsgType.BINARY))
            except (ConnectionError, TimeoutError):
                tried.append(("a frame over the size limit", True))
    return tried


async def _hostile_connections(
    p: Pki, secure: list[str], plain: list[str], coord: Coordinator, prompt: list[int]
) -> dict[str, Any]:
    """Each attempt: (what, whether it was refused)."""
    tried: list[tuple[str, bool]] = []
    ca = (p.ca_dir / files.CA_CERT).read_text()
    revoked = p.spare.client_ssl_context()
    bare = ssl.create_default_context(cadata=ca)
    bare.check_hostname = False
    outsider = p.outsider.client_ssl_context()
    outsider.load_verify_locations(cadata=ca)  # trust the server: only the server may refuse
    outsider.check_hostname = False
    for node in secure:
        tried.append(("plaintext websocket to a TLS port", await _refused(f"ws://{node}/ws", False)))
        tried.append(("TLS without a certificate", await _refused(f"wss://{node}/ws", bare)))
        tried.append(("another cluster's certificate", await _refused(f"wss://{node}/ws", outsider)))
    revoked_list = cluster.revoke(p.spare.node_id, p.ca_dir)
    for home in p.homes[1:]:  # members get the new list by hand (it is not gossiped yet: SECURITY.md)
        files.write_json(home / "config" / "security" / files.REVOKED, revoked_list.to_json())
    await asyncio.sleep(transport.REFRESH_S + 1.0)  # the agents re-read the revocation list
    for node in secure:
        tried.append(("a revoked member's certificate", await _refused(f"wss://{node}/ws", revoked)))
    tried += await _plain_attacks(plain, coord, prompt)
    for what, refused in tried:
        if not refused:
            _say(f"ACCEPTED: {what}")
    return {"hostile_tried": len(tried), "hostile_accepted": sum(not r for _, r in tried)}


async def _fuzz(
    coord: Coordinator, nodes: list[str], prompt: list[int], n: int, hidden: int, seed: int
) -> dict[str, Any]:
    reference = await generate(coord, prompt, 32)
    hostile = Hostile([f"ws://{x}/ws" for x in nodes])
    async with hostile:
        name_streams(coord, hostile)
        until = asyncio.Event()
        runner = asyncio.create_task(healthy(coord, prompt, 32, reference, until, hostile.reveal))
        frames = hostile_frames(seed, coord.cfg.term, hidden, victim=VICTIM_MARK)
        t0 = time.monotonic()
        for i in range(n):
            await hostile.send(next(frames))
            if (i + 1) % 10000 == 0:
                _say(f"fuzz: {i + 1} frames, {hostile.tally.hangs} hangs, {time.monotonic() - t0:.0f}s")
        until.set()
        runs, differ = await runner
    for d in differ:
        _say(f"fuzz: a healthy stream differed: {d}")
    t = hostile.tally
    _say(f"fuzz: {t.sent} frames, {t.errors} errors, {t.closes} closes, {t.hangs} hangs; codes {t.codes}")
    return {
        "fuzz_inputs": t.sent,
        "fuzz_hangs": t.hangs,
        "fuzz_errors": t.errors,
        "fuzz_not_owner": t.codes.get("not_owner", 0),
        "healthy_runs": runs,
        "healthy_stream_identical": not differ and runs > 0 and await generate(coord, prompt, 32) == reference,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.fuzz < 0 or args.runs < 1:
        raise BenchError("--fuzz must be >= 0 and --runs >= 1")
    model = resolve_model(args.model, False, bool(args.json))
    hidden = model.hidden_size
    rng = np.random.default_rng(1)
    prompt = [int(x) for x in rng.integers(100, 20000, args.prompt_tokens)]
    with tempfile.TemporaryDirectory(prefix="lakeshard-bench-security-") as tmp:
        ports = [free_port(), free_port()]
        p = Pki(Path(tmp), ports)
        cores = [[c] for c in sorted(os.sched_getaffinity(0))[:2]]
        cores = cores if len(cores) == 2 else [[cores[0][0]], [cores[0][0]]]
        sec = LocalCluster(2, cores=cores, threads=1, device="CPU", agent_envs=p.envs(), ports=ports, secure=True)
        plain = LocalCluster(2, cores=cores, threads=1, device="CPU")
        with sec, plain:
            return aio.run(_main(args, model, p, sec, plain, prompt, hidden))


async def _main(
    args: argparse.Namespace, model: Any, p: Pki, sec: LocalCluster, plain: LocalCluster, prompt: list[int], hidden: int
) -> dict[str, Any]:
    opts = ExportOptions(weights=args.weights)

    def cfg(nodes: list[str], term: int, t: transport.Transport) -> ServeConfig:
        # exact (f32 activations and wire): a healthy run's tokens do not depend on which numeric
        # path (a split head or not) the other streams on a stage make it take
        return ServeConfig(
            nodes=nodes,
            model=model,
            opts=opts,
            transport=t,
            quiet=True,
            term=term,
            max_streams=1,
            api=False,
            exact=True,
            wire_dtype="f32",
        )

    async def start(first: str, term: int) -> dict[str, Coordinator]:
        made = {}
        for name in (first, "plain" if first == "tls" else "tls"):
            t = transport.Transport(p.coordinator) if name == "tls" else transport.PLAINTEXT
            made[name] = await _start(cfg(sec.nodes if name == "tls" else plain.nodes, term, t))
        return made

    # The coordinator started first runs a few per cent slower in this harness, plaintext or
    # not (two plaintext clusters: 0.95-0.97), so half the pairs start the TLS one first and
    # half the plaintext one, and their ratios are pooled.
    out: dict[str, Any] = {"model": model.name, "weights": args.weights, "tokens": args.tokens, "runs": args.runs}
    pids = [os.getpid(), *(x.pid for x in [*sec.procs, *plain.procs])]
    coords = await start("tls", 1)
    try:
        first = await _tls_pairs(coords, prompt, args.tokens, (args.runs + 1) // 2, pids)
    finally:
        for c in coords.values():
            await c.async_stop()
    coords = await start("plain", 2)
    try:
        second = await _tls_pairs(coords, prompt, args.tokens, args.runs // 2, pids) if args.runs > 1 else first
        out |= _pooled(first, second)
        out |= await _fuzz(coords["plain"], plain.nodes, prompt, args.fuzz, hidden, args.seed)
        out |= await _hostile_connections(p, sec.nodes, plain.nodes, coords["plain"], prompt)
        agents_alive = all(x.poll() is None for x in [*sec.procs, *plain.procs])
    finally:
        for c in coords.values():
            await c.async_stop()
    crashes = 0 if agents_alive else 1
    head = {
        "suite": "security",
        "tls_ratio": out.pop("tls_ratio"),
        "fuzz_inputs": out.pop("fuzz_inputs"),
        "fuzz_crashes": crashes,
        "fuzz_hangs": out.pop("fuzz_hangs"),
        "hostile_tried": out.pop("hostile_tried"),
        "hostile_accepted": out.pop("hostile_accepted"),
        "healthy_stream_identical": out.pop("healthy_stream_identical"),
    }
    return {**head, **out, "agents_alive": agents_alive}


def add_args(sub: Any) -> None:
    sp = sub.add_parser("security", help="mTLS vs plaintext tok/s, live fuzzing and hostile connections")
    sp.add_argument("--model", default="smollm2-135m")
    sp.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"], default="int8")
    sp.add_argument("--tokens", type=int, default=64, help="tokens per timed run")
    sp.add_argument("--prompt-tokens", type=int, default=32)
    sp.add_argument("--runs", type=int, default=6, help="timed runs per transport (alternating)")
    sp.add_argument("--fuzz", type=int, default=100_000, help="hostile frames sent to the live stages")
    sp.add_argument("--seed", type=int, default=random.Random(26).randrange(1 << 30), help="the fuzzer's seed")
    sp.add_argument("--json", action="store_true", help="progress on stderr only (the JSON line is always last)")
