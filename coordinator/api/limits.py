"""Request limits of the OpenAI-compatible API: a rate and a concurrency cap per client.

Pure decisions, with the clock passed in (tests drive it by hand):

* the rate: a token bucket per client, refilled at ``rate`` requests per minute and holding
  at most ``burst`` (default a sixth of the per-minute figure, at least 1: ten seconds'
  worth), so a client may send a few requests in a row and then one every 60/rate seconds;
* concurrency: requests in flight per client, and in all (a streamed answer holds its slot
  until its stream ends).

Who a client is: ``serve`` has one API key, shared by every client, so the key does not tell
clients apart; the client is its address (:func:`client_key`). Requests that arrive through
an agent's gateway come from 127.0.0.1; the gateway names the address it received them from
in ``X-Forwarded-For``, trusted from loopback peers only. So a member laptop counts as one
client (everyone on it together), the coordinator laptop's own users as 127.0.0.1.

Memory is bounded: at most ``max_clients`` buckets, the least recently seen forgotten first
(a forgotten client starts again with a full bucket); in-flight counts exist only while a
request is in flight.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from agent.common.limits import (
    MAX_CLIENTS,
    NETWORK_CONCURRENCY,
    NETWORK_RATE,
    TOTAL_INFLIGHT,
)


@dataclass(frozen=True)
class Limits:
    rate: int = 0  # requests per minute per client; 0: unlimited
    concurrency: int = 0  # requests in flight per client; 0: unlimited
    total: int = 0  # requests in flight in all; 0: unlimited
    burst: int = 0  # the bucket's size; 0: rate / 6, at least 1

    def __post_init__(self) -> None:
        for name in ("rate", "concurrency", "total", "burst"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")

    @property
    def bucket(self) -> int:
        return self.burst or max(1, self.rate // 6)

    @property
    def any(self) -> bool:
        return bool(self.rate or self.concurrency or self.total)

    def describe(self) -> str:
        """One line for the startup message and status."""
        parts = []
        if self.rate:
            parts.append(f"{self.rate} requests/min (burst {self.bucket})")
        if self.concurrency:
            parts.append(f"{self.concurrency} in flight")
        per_client = " and ".join(parts) if parts else "none"
        return f"{per_client} per client" + (f", {self.total} in flight in all" if self.total else "")


def resolve(loopback: bool, rate: int | None, concurrency: int | None, total: int = TOTAL_INFLIGHT) -> Limits:
    """The limits ``serve`` applies: what was set, else unlimited on loopback and the
    network defaults elsewhere."""
    if rate is None:
        rate = 0 if loopback else NETWORK_RATE
    if concurrency is None:
        concurrency = 0 if loopback else NETWORK_CONCURRENCY
    return Limits(rate=rate, concurrency=concurrency, total=total)


@dataclass(frozen=True)
class Bucket:
    tokens: float
    at: float  # when ``tokens`` was counted


def take(bucket: Bucket | None, now: float, rate: int, burst: int) -> tuple[Bucket, float]:
    """Take one request's token: (the bucket after, 0.0) or, when none is left,
    (the bucket refilled to ``now``, seconds until a token is there). None: a new client."""
    if bucket is None:
        tokens = float(burst)
    else:
        elapsed = max(0.0, now - bucket.at)  # a clock that stepped back refills nothing
        tokens = min(float(burst), bucket.tokens + elapsed * rate / 60.0)
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, now), 0.0
    return Bucket(tokens, now), (1.0 - tokens) * 60.0 / rate


def retry_after(wait_s: float) -> int:
    """A Retry-After header's whole seconds: rounded up, at least 1."""
    return max(1, math.ceil(wait_s - 1e-9))


@dataclass(frozen=True)
class Refusal:
    code: str  # rate_limit_exceeded or too_many_concurrent_requests
    message: str
    retry_after: int  # seconds


class Limiter:
    """The decisions for every client: :meth:`admit` each request, :meth:`release` each one
    admitted with ``hold`` when it ends (its stream included)."""

    def __init__(
        self, limits: Limits, clock: Callable[[], float] = time.monotonic, max_clients: int = MAX_CLIENTS
    ) -> None:
        if max_clients < 1:
            raise ValueError("max_clients must be at least 1")
        self.limits, self.clock, self.max_clients = limits, clock, max_clients
        self.buckets: OrderedDict[str, Bucket] = OrderedDict()
        self.inflight: dict[str, int] = {}
        self.total = 0

    def admit(self, client: str, hold: bool = True) -> Refusal | None:
        """None: go ahead (and, with ``hold``, the request holds a slot until released)."""
        lim = self.limits
        if hold:  # checked first: a request refused here does not spend its client's rate
            if lim.concurrency and self.inflight.get(client, 0) >= lim.concurrency:
                return Refusal(
                    "too_many_concurrent_requests",
                    f"too many requests in flight from this client: at most {lim.concurrency} at once; "
                    "retry when one of them has ended",
                    1,
                )
            if lim.total and self.total >= lim.total:
                return Refusal(
                    "too_many_concurrent_requests",
                    f"the server has {lim.total} requests in flight, its limit; retry shortly",
                    1,
                )
        if lim.rate:
            bucket, wait = take(self.buckets.get(client), self.clock(), lim.rate, lim.bucket)
            self.buckets[client] = bucket
            self.buckets.move_to_end(client)
            while len(self.buckets) > self.max_clients:
                self.buckets.popitem(last=False)  # the least recently seen client
            if wait > 0:
                after = retry_after(wait)
                return Refusal(
                    "rate_limit_exceeded",
                    f"rate limit reached: {lim.rate} requests per minute per client "
                    f"(burst {lim.bucket}); retry in {after} s",
                    after,
                )
        if hold:
            self.inflight[client] = self.inflight.get(client, 0) + 1
            self.total += 1
        return None

    def release(self, client: str) -> None:
        n = self.inflight.get(client, 0)
        if n <= 0:
            return  # never admitted with hold (or released twice): nothing to give back
        if n == 1:
            del self.inflight[client]
        else:
            self.inflight[client] = n - 1
        self.total = max(0, self.total - 1)


def _ip(v: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(v.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def client_key(peer: str | None, forwarded: str | None = None) -> str:
    """Who a request counts for: the peer's address, or, from a loopback peer (an agent's
    gateway, a local reverse proxy), the last address of its ``X-Forwarded-For`` (the one that
    peer added). An IPv6 client counts by its /64 (one machine can hold a whole /64)."""
    ip = _ip(peer) if peer else None
    if ip is not None and ip.is_loopback and forwarded:
        fwd = _ip(forwarded[-100:].rsplit(",", 1)[-1])
        if fwd is not None:
            ip = fwd
    if ip is None:
        return peer[:64] if peer else "unknown"  # a unix socket or the like: its name
    if isinstance(ip, ipaddress.IPv6Address) and not ip.is_loopback:
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)
