"""Request limits of the OpenAI-compatible API: the pure decisions (token bucket, concurrency,
who a client is, the defaults), their settings, the gateway's forwarding, and a real
``lakeshard serve`` answering the official ``openai`` client with 429s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.common.limits import NETWORK_CONCURRENCY, NETWORK_RATE, TOTAL_INFLIGHT
from coordinator.api.limits import (
    Bucket,
    Limiter,
    Limits,
    client_key,
    resolve,
    retry_after,
    take,
)
from tests.support.cli import run_cli
from tests.support.served import Served
from tests.support.wait import wait_until


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# -- the token bucket ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bucket", "now", "rate", "burst", "tokens_after", "wait"),
    [
        (None, 0.0, 6, 1, 0.0, 0.0),  # a new client starts with a full bucket
        (None, 0.0, 60, 10, 9.0, 0.0),
        (Bucket(0.0, 0.0), 0.0, 6, 1, 0.0, 10.0),  # empty: one token per 10 s at 6/min
        (Bucket(0.0, 0.0), 4.0, 6, 1, 0.4, 6.0),  # refilling: 4 s gave 0.4 of a token
        (Bucket(0.0, 0.0), 10.0, 6, 1, 0.0, 0.0),  # refilled exactly: taken
        (Bucket(0.0, 0.0), 3600.0, 6, 1, 0.0, 0.0),  # an hour idle fills only up to the burst
        (Bucket(0.0, 0.0), 3600.0, 60, 10, 9.0, 0.0),
        (Bucket(2.5, 0.0), 0.0, 60, 10, 1.5, 0.0),
        (Bucket(0.5, 0.0), 0.0, 60, 10, 0.5, 0.5),  # half a token: half a second at 1/s
        (Bucket(0.0, 50.0), 40.0, 6, 1, 0.0, 10.0),  # a clock that stepped back refills nothing
    ],
)
def test_the_token_bucket(
    bucket: Bucket | None, now: float, rate: int, burst: int, tokens_after: float, wait: float
) -> None:
    after, w = take(bucket, now, rate, burst)
    assert after.tokens == pytest.approx(tokens_after)
    assert after.at == now
    assert w == pytest.approx(wait)


@pytest.mark.parametrize(("wait", "header"), [(0.001, 1), (0.5, 1), (1.0, 1), (1.2, 2), (9.999, 10), (10.0, 10)])
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(wait: float, header: int) -> None:
    assert retry_after(wait) == header


@pytest.mark.parametrize(("rate", "burst", "bucket"), [(6, 0, 1), (5, 0, 1), (60, 0, 10), (600, 0, 100), (60, 3, 3)])
def test_the_burst_is_a_sixth_of_the_rate_at_least_one_unless_set(rate: int, burst: int, bucket: int) -> None:
    assert Limits(rate=rate, burst=burst).bucket == bucket


# -- the limiter: a script of (seconds since start, client, holds a slot, expected) -----------------

OK = None
RATE = "rate_limit_exceeded"
BUSY = "too_many_concurrent_requests"
Step = tuple[float, str, str, Any]  # (time, client, "admit"|"models"|"release", expected code or retry)

SCRIPTS: dict[str, tuple[Limits, list[Step]]] = {
    "refill over time (6/min: burst 1, a token per 10 s)": (
        Limits(rate=6),
        [
            (0, "a", "models", OK),
            (0, "a", "models", (RATE, 10)),
            (4, "a", "models", (RATE, 6)),
            (9.5, "a", "models", (RATE, 1)),
            (10, "a", "models", OK),
            (10, "a", "models", (RATE, 10)),
            (30, "a", "models", OK),  # 20 s idle saved only one token (the burst)
            (30, "a", "models", (RATE, 10)),
        ],
    ),
    "a burst, then the steady rate (60/min: burst 10)": (
        Limits(rate=60),
        [*[(0, "a", "models", OK) for _ in range(10)], (0, "a", "models", (RATE, 1)), (1, "a", "models", OK)],
    ),
    "clients are counted apart": (
        Limits(rate=6, concurrency=1),
        [
            (0, "a", "admit", OK),
            (0, "a", "models", (RATE, 10)),
            (0, "b", "admit", OK),  # another client: its own bucket and its own slot
            (0, "b", "admit", BUSY),
            (0, "c", "models", OK),
        ],
    ),
    "a slot comes back when its request ends": (
        Limits(concurrency=2),
        [
            (0, "a", "admit", OK),
            (0, "a", "admit", OK),
            (0, "a", "admit", (BUSY, 1)),
            (0, "a", "models", OK),  # /v1/models needs no slot
            (1, "a", "release", None),
            (1, "a", "admit", OK),
            (1, "a", "admit", BUSY),
        ],
    ),
    "a request refused for concurrency keeps its client's rate": (
        Limits(rate=12, concurrency=1),  # burst 2
        [
            (0, "a", "admit", OK),
            (0, "a", "admit", BUSY),
            (0, "a", "admit", BUSY),
            (0, "a", "release", None),
            (0, "a", "admit", OK),  # the second token is still there
            (0, "a", "release", None),
            (0, "a", "admit", RATE),
        ],
    ),
    "the cap on everything in flight": (
        Limits(total=2),
        [
            (0, "a", "admit", OK),
            (0, "b", "admit", OK),
            (0, "c", "admit", (BUSY, 1)),
            (0, "c", "models", OK),
            (0, "a", "release", None),
            (0, "c", "admit", OK),
        ],
    ),
    "a release that was never admitted gives nothing back": (
        Limits(concurrency=1, total=1),
        [
            (0, "a", "release", None),
            (0, "a", "release", None),
            (0, "a", "admit", OK),
            (0, "b", "release", None),
            (0, "b", "admit", BUSY),  # the total is still held by a
        ],
    ),
    "no limits": (Limits(), [*[(0, "a", "admit", OK) for _ in range(100)], (0, "a", "models", OK)]),
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_limiter_decisions(name: str) -> None:
    limits, script = SCRIPTS[name]
    clock = Clock()
    lim = Limiter(limits, clock)
    start = clock.t
    for i, (at, client, what, want) in enumerate(script):
        clock.t = start + at
        if what == "release":
            lim.release(client)
            continue
        got = lim.admit(client, hold=what == "admit")
        code, after = want if isinstance(want, tuple) else (want, None)
        assert (got.code if got else None) == code, f"step {i}: {got}"
        if after is not None:
            assert got is not None and got.retry_after == after, f"step {i}: {got}"
    assert lim.total == sum(lim.inflight.values())
    assert all(n > 0 for n in lim.inflight.values())


def test_refusals_say_which_limit_and_when_to_retry() -> None:
    lim = Limiter(Limits(rate=6, concurrency=1, total=5), Clock())
    assert lim.admit("a") is None
    busy = lim.admit("a")
    assert busy is not None and "at most 1 at once" in busy.message and busy.retry_after == 1
    rate = lim.admit("a", hold=False)
    assert rate is not None and rate.code == RATE
    assert "6 requests per minute per client" in rate.message and "retry in 10 s" in rate.message
    lim2 = Limiter(Limits(total=1), Clock())
    assert lim2.admit("a") is None
    full = lim2.admit("b")
    assert full is not None and "the server has 1 requests in flight" in full.message


def test_memory_is_bounded_forgetting_the_least_recently_seen_client() -> None:
    clock = Clock()
    lim = Limiter(Limits(rate=6), clock, max_clients=3)
    for c in ("a", "b", "c"):
        assert lim.admit(c, hold=False) is None
    assert lim.admit("a", hold=False) is not None  # a is seen again (refused): now the most recent
    assert lim.admit("d", hold=False) is None  # b, the least recently seen, is forgotten
    assert list(lim.buckets) == ["c", "a", "d"]
    assert lim.admit("b", hold=False) is None  # forgotten: starts again with a full bucket
    assert len(lim.buckets) == 3
    for i in range(10_000):  # many clients, once each: never more than the bound
        lim.admit(f"10.0.{i // 256}.{i % 256}", hold=False)
    assert len(lim.buckets) == 3
    assert lim.inflight == {} and lim.total == 0


def test_in_flight_counts_exist_only_while_requests_are_in_flight() -> None:
    lim = Limiter(Limits(concurrency=4), Clock())
    for i in range(1000):
        assert lim.admit(f"c{i}") is None
    assert lim.total == 1000
    for i in range(1000):
        lim.release(f"c{i}")
    assert lim.inflight == {} and lim.total == 0


@pytest.mark.parametrize(
    ("peer", "forwarded", "client"),
    [
        ("10.0.0.5", None, "10.0.0.5"),
        ("10.0.0.5", "1.2.3.4", "10.0.0.5"),  # from the network: its own say-so is ignored
        ("127.0.0.1", None, "127.0.0.1"),
        ("127.0.0.1", "10.0.0.7", "10.0.0.7"),  # an agent's gateway names its client
        ("::1", "10.0.0.7", "10.0.0.7"),
        ("127.0.0.1", "6.6.6.6, 10.0.0.7", "10.0.0.7"),  # a proxy appends: its own entry is the last
        ("127.0.0.1", " 10.0.0.7 ", "10.0.0.7"),
        ("127.0.0.1", "not an address", "127.0.0.1"),  # garbage: the peer itself
        ("127.0.0.1", "", "127.0.0.1"),
        ("127.0.0.1", "x" * 100_000, "127.0.0.1"),
        ("::ffff:10.0.0.9", None, "10.0.0.9"),  # IPv4 mapped into IPv6: the same client
        ("2001:db8:1:2:aaaa::1", None, "2001:db8:1:2::/64"),  # IPv6: by its /64
        ("2001:db8:1:2:bbbb::9", None, "2001:db8:1:2::/64"),
        ("127.0.0.1", "[2001:db8::5]", "2001:db8::/64"),
        (None, "10.0.0.7", "unknown"),
        ("some-socket", "10.0.0.7", "some-socket"),
    ],
)
def test_who_a_client_is(peer: str | None, forwarded: str | None, client: str) -> None:
    assert client_key(peer, forwarded) == client


@pytest.mark.parametrize(
    ("loopback", "rate", "concurrency", "want"),
    [
        (True, None, None, (0, 0)),  # loopback: unlimited unless set
        (True, 30, None, (30, 0)),
        (True, None, 2, (0, 2)),
        (False, None, None, (NETWORK_RATE, NETWORK_CONCURRENCY)),  # open to the network: 60/min, 4
        (False, 0, None, (0, NETWORK_CONCURRENCY)),  # 0 turns one off
        (False, 600, 0, (600, 0)),
    ],
)
def test_defaults_depend_on_where_the_api_listens(
    loopback: bool, rate: int | None, concurrency: int | None, want: tuple[int, int]
) -> None:
    lim = resolve(loopback, rate, concurrency)
    assert (lim.rate, lim.concurrency, lim.total) == (*want, TOTAL_INFLIGHT)


@pytest.mark.parametrize(
    ("limits", "text"),
    [
        (
            Limits(rate=60, concurrency=4, total=64),
            "60 requests/min (burst 10) and 4 in flight per client, 64 in flight in all",
        ),
        (Limits(total=64), "none per client, 64 in flight in all"),
        (Limits(concurrency=1), "1 in flight per client"),
    ],
)
def test_limits_in_one_line(limits: Limits, text: str) -> None:
    assert limits.describe() == text


@pytest.mark.parametrize("bad", [{"rate": -1}, {"concurrency": True}, {"total": 1.5}, {"burst": "3"}])
def test_limits_refuse_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        Limits(**bad)


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("serve", "want"),
    [
        ({}, (0, 0)),
        ({"api_rate": 30, "api_concurrency": 2}, (30, 2)),
        ({"api_rate": 0, "api_concurrency": None}, (0, 0)),
    ],
)
def test_config_serve_limits(serve: dict[str, Any], want: tuple[int, int]) -> None:
    from agent.common.config import parse

    s = parse({"serve": serve})
    assert (s.serve_api_rate, s.serve_api_concurrency) == want


@pytest.mark.parametrize(
    ("serve", "message"),
    [
        ({"api_rate": -1}, "serve.api_rate: -1 is not a number of requests per minute"),
        ({"api_rate": "60"}, "serve.api_rate: '60' is not a number"),
        ({"api_rate": True}, "serve.api_rate: True is not a number"),
        ({"api_rate": 2.5}, "serve.api_rate: 2.5 is not a number"),
        ({"api_rate": 10**9}, "(0-1000000; 0: unlimited)"),
        ({"api_concurrency": -3}, "serve.api_concurrency: -3 is not a number of requests in flight"),
        ({"api_concurency": 2}, "serve: unknown setting(s): api_concurency"),
    ],
)
def test_config_serve_limits_are_validated(serve: dict[str, Any], message: str) -> None:
    from agent.common.config import ConfigError, parse

    with pytest.raises(ConfigError) as e:
        parse({"serve": serve})
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--api-rate", "-1"], "expected a number of requests per minute (0: unlimited), got '-1'"),
        (["--api-rate", "fast"], "expected a number of requests per minute"),
        (["--api-concurrency", "2.5"], "expected a number of requests in flight"),
        (["--api-concurrency", "100000"], "--api-concurrency: at most 10000"),
    ],
)
def test_serve_limit_flags_are_validated(args: list[str], message: str) -> None:
    r = run_cli("serve", "--nodes", "127.0.0.1:7700", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


# -- the gateway names the real client (real sockets) ---------------------------------------------


def test_the_gateway_names_who_it_forwards_for_and_passes_retry_after_back() -> None:
    import aiohttp
    from aiohttp import web

    from agent.api.gateway import async_forward
    from agent.common import aio

    async def upstream(request: web.Request) -> web.Response:
        return web.json_response(
            {"forwarded_for": request.headers.get("X-Forwarded-For")}, status=429, headers={"Retry-After": "7"}
        )

    async def main() -> tuple[int, str | None, Any]:
        up_app = web.Application()
        up_app.router.add_post("/v1/chat/completions", upstream)
        runners: list[web.AppRunner] = []

        async def serve(app: web.Application) -> int:
            """Serve ``app`` on a free loopback port (0): the port it bound."""
            r = web.AppRunner(app)
            await r.setup()
            runners.append(r)
            await web.TCPSite(r, "127.0.0.1", 0).start()
            return int(r.addresses[0][1])

        async with aiohttp.ClientSession() as session:

            async def door(request: web.Request) -> web.StreamResponse:
                return await async_forward(request, f"http://127.0.0.1:{up_port}{request.rel_url}", session)

            door_app = web.Application()
            door_app.router.add_post("/v1/chat/completions", door)
            up_port = await serve(up_app)
            door_port = await serve(door_app)
            try:
                async with session.post(
                    f"http://127.0.0.1:{door_port}/v1/chat/completions",
                    json={},
                    headers={"X-Forwarded-For": "6.6.6.6"},  # a client's own claim is not passed on
                ) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.json()
            finally:
                for r in runners:
                    await r.cleanup()

    status, after, body = aio.run(main())
    assert (status, after) == (429, "7")
    assert body == {"forwarded_for": "127.0.0.1"}  # the address the door saw


# -- a real serve process and the openai client ---------------------------------------------------


def _client(served: Served, who: str | None = None) -> Any:
    """An openai client of ``served``; ``who``: the address an agent's gateway would name."""
    import openai

    headers = {"X-Forwarded-For": who} if who else None
    return openai.OpenAI(
        base_url=f"{served.api_url}/v1", api_key="unused", max_retries=0, timeout=60, default_headers=headers
    )


MSGS = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def rate_limited(smollm2) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    s = Served(2, "--model", "smollm2-135m", "--weights", "int8", "--api-rate", "6")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def one_at_a_time(smollm2) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    s = Served(2, "--model", "smollm2-135m", "--weights", "int8", "--api-concurrency", "1")
    yield s
    s.stop()


def test_over_the_rate_a_client_gets_429_while_its_stream_and_other_clients_carry_on(rate_limited: Served) -> None:
    import openai

    assert "limits: 6 requests/min (burst 1) per client" in "".join(rate_limited.output)
    limited = _client(rate_limited, "10.9.0.1")
    stream = limited.chat.completions.create(
        model="smollm2-135m", messages=MSGS, stream=True, max_tokens=48, temperature=0
    )  # type: ignore[arg-type]
    chunks = iter(stream)
    pieces = [next(chunks).choices[0].delta.content or "" for _ in range(3)]
    for call in (
        lambda: limited.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=4),  # type: ignore[arg-type]
        lambda: limited.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=4, stream=True),  # type: ignore[arg-type]
        lambda: limited.models.list(),
    ):
        with pytest.raises(openai.RateLimitError) as e:
            call()
        assert e.value.code == "rate_limit_exceeded"
        assert "6 requests per minute" in e.value.message and "retry in" in e.value.message
        after = e.value.response.headers["Retry-After"]
        assert after.isdigit() and 1 <= int(after) <= 10
        assert e.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    # another client is not held back
    other = _client(rate_limited, "10.9.0.2")
    ok = other.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=4)  # type: ignore[arg-type]
    assert ok.choices[0].message.content
    # and the limited client's stream finishes unharmed
    finish = None
    for chunk in chunks:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish in ("length", "stop")
    assert len("".join(pieces)) > 20


def test_over_the_concurrency_cap_429_until_the_open_stream_is_dropped(one_at_a_time: Served) -> None:
    import openai

    client = _client(one_at_a_time)
    stream = client.chat.completions.create(model="smollm2-135m", messages=MSGS, stream=True, max_tokens=2000)  # type: ignore[arg-type]
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=4)  # type: ignore[arg-type]
    assert e.value.code == "too_many_concurrent_requests"
    assert "at most 1 at once" in e.value.message
    assert e.value.response.headers["Retry-After"] == "1"
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]  # needs no slot
    other = _client(one_at_a_time, "10.9.0.3")  # another client has its own slot
    assert other.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=2).choices  # type: ignore[arg-type]

    def slot(**kw: Any) -> Any:
        """A request of this client (its answer), or None while it is refused for want of a slot."""
        try:
            return client.chat.completions.create(model="smollm2-135m", messages=MSGS, **kw)  # type: ignore[arg-type]
        except openai.RateLimitError as busy:
            assert busy.code == "too_many_concurrent_requests", busy  # any other refusal fails at once
            return None

    stream.close()  # the client hangs up mid-answer
    t0 = time.monotonic()
    again = wait_until(
        lambda: slot(stream=True, max_tokens=2000),
        1.0,
        what="the dropped stream's slot to be free",
        ok=lambda r: r is not None,
        step=0.02,
    )
    took = time.monotonic() - t0
    assert took < 1.0
    assert next(iter(again)).choices  # the new request is being answered
    again.close()
    # the slot is back again after that one too (nothing leaks)
    last = wait_until(
        lambda: slot(max_tokens=2),
        1.0,
        what="the slot back after the second stream",
        ok=lambda r: r is not None,
        step=0.02,
    )
    assert last.choices


def test_bad_input_under_limits_gets_its_own_error_and_gives_its_slot_back(one_at_a_time: Served) -> None:
    import openai

    client = _client(one_at_a_time, "10.9.0.4")
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="smollm2-135m", messages=[], max_tokens=2)  # type: ignore[arg-type]
    assert client.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=2).choices  # type: ignore[arg-type]


def test_a_legacy_completion_holds_a_slot_as_a_chat_does_and_a_model_lookup_needs_none(one_at_a_time: Served) -> None:
    """``/v1/completions`` (here through the batching ring) counts toward concurrency;
    ``/v1/models/{id}`` only toward the rate."""
    import openai

    client = _client(one_at_a_time, "10.9.0.5")
    stream = client.completions.create(model="smollm2-135m", prompt="Once upon a time", stream=True, max_tokens=2000)
    chunks = iter(stream)
    first = [next(chunks).choices[0].text for _ in range(3)]
    assert "".join(first)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=2)
    assert e.value.code == "too_many_concurrent_requests"
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"  # needs no slot
    stream.close()
    again = wait_until(
        lambda: _or_none(lambda: client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=2)),
        1.0,
        what="the dropped completion's slot to be free",
        ok=lambda r: r is not None,
        step=0.02,
    )
    assert again.object == "text_completion" and again.choices[0].text


def _or_none(call: Any) -> Any:
    """``call()``, or None while it is refused for want of a slot."""
    import openai

    try:
        return call()
    except openai.RateLimitError as busy:
        assert busy.code == "too_many_concurrent_requests", busy
        return None
