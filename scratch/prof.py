"""Ad-hoc: where does a pipeline step's time go? (not committed)"""
import asyncio, json, os, sys, statistics, time
import aiohttp
from agent import aio
from agent.bench.pipeline import resolve_model, _mono, _prompt
from agent.export.exporter import ExportOptions, export_model
from coordinator.local_cluster import LocalCluster
from coordinator.scheduler import GenRequest
from coordinator.serve import Coordinator, ServeConfig, plan_ranges

C = int(os.environ.get("C", "4"))
STAGES = [int(x) for x in os.environ.get("STAGES", "2").split(",")]
STREAMS = [int(x) for x in os.environ.get("STREAMS", "1").split(",")]
TOK = int(os.environ.get("TOK", "64"))
model = resolve_model(os.environ.get("MODEL", "qwen2.5-coder-0.5b"), bool(int(os.environ.get("RANDOM", "1"))), True)
opts = ExportOptions(weights="int4")
whole = export_model(model, [(0, model.num_layers)], opts, quiet=True)
prompt = _prompt(model, whole.dir, 32)
avail = sorted(os.sched_getaffinity(0))
cores = [avail[i*C:(i+1)*C] for i in range(max(STAGES))]
spare = avail[max(STAGES)*C:]
if spare: os.sched_setaffinity(0, spare)
print("mono", _mono(whole.dir, cores[0], prompt, TOK, 3), flush=True)

async def status(node):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://{node}/v1/node") as r:
            return await r.json()

async def measure(cfg, k):
    coord = Coordinator(cfg); await coord.async_start()
    try:
        sched = coord.scheduler
        async def one(n):
            req = GenRequest(prompt=tuple(prompt), max_tokens=n, ids_only=True)
            return sum([1 async for _ in sched.async_generate(req)])
        await asyncio.gather(*[one(4) for _ in range(k)])
        sp = []
        for _ in range(3):
            t0 = time.perf_counter(); c = await asyncio.gather(*[one(TOK) for _ in range(k)]); sp.append(sum(c)/(time.perf_counter()-t0))
        sts = [await status(n) for n in cfg.nodes]
        return statistics.median(sp), [(s.get("stage") or s).get("step_ms_p50") or 0 for s in sts]
    finally:
        await coord.async_stop()

term = 0
for s in STAGES:
    ex = export_model(model, plan_ranges(model, s, None), opts, quiet=True)
    with LocalCluster(s, cores=cores[:s], threads=C, device="CPU", env=json.loads(os.environ.get("AGENT_ENV", "{}"))) as cl:
        for k in STREAMS:
            term += 1
            cfg = ServeConfig(nodes=cl.nodes, model=model, opts=opts, api_port=0, quiet=True, term=term, max_streams=k, api=False, ring_loop=True)
            tps, steps = aio.run(measure(cfg, k))
            per = 1000 / tps * k
            print(f"{s}x{k}: {tps:.2f} tok/s, per-token-per-stream {per:.2f} ms, stage steps p50 {steps}, sum {sum(steps):.2f}", flush=True)
print("mono", _mono(whole.dir, cores[0], prompt, TOK, 3), flush=True)
