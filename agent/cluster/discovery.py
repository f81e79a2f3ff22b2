"""mDNS discovery (python-zeroconf, async API): advertise this node, find the others.

Service ``_lakeshard._tcp.local.``; one instance per node, named after its node id. The TXT
record carries what a coordinator needs to know before it talks to a node (DESIGN.md):
``id`` node id, ``cl`` cluster id, ``v`` version, ``dev`` device kinds, ``mem`` free memory
(MiB), ``score`` speed (GFLOP/s), ``st`` throttle state, ``port``. Every value is checked
(:func:`parse_txt`); a forged or malformed advertisement, or one from another cluster, is
dropped with a log line. The TXT is re-announced when something in it changes, and a clean
shutdown says goodbye. Liveness itself comes from the peers' beats (:mod:`agent.cluster.elector`):
mDNS only tells us where they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.protocol.control import ID_RE, KIND_RE, MAX_MEM, MAX_SCORE, STATES
from agent.runtime.kv_budget import kv_pool_bytes

if TYPE_CHECKING:  # zeroconf is imported only when mDNS is used (standalone agents do without)
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)
SERVICE = "_lakeshard._tcp.local."
MIB = 1024 * 1024
GOODBYE_S = 0.4  # on shutdown: for the mDNS goodbye to go out before the sockets close


class AdvertError(ValueError):
    pass


@dataclass(frozen=True)
class Advert:
    node: str
    cluster: str
    version: str
    devices: tuple[str, ...]
    mem_free: int  # bytes (advertised in MiB)
    score: float
    state: str
    port: int
    addresses: tuple[str, ...] = ()
    reason: str | None = None  # why it is limited or paused
    kv_pool: int = 0  # bytes a paged stage here would give its KV blocks (advertised in MiB; 0: not said)

    def txt(self) -> dict[str, str]:
        extra = {"why": self.reason[:64]} if self.reason else {}
        return {
            **extra,
            "kv": str((self.kv_pool or kv_pool_bytes(self.mem_free)) // MIB),
            "id": self.node,
            "cl": self.cluster,
            "v": self.version,
            "dev": ",".join(self.devices),
            "mem": str(self.mem_free // MIB),
            "score": f"{self.score:.1f}",
            "st": self.state,
            "port": str(self.port),
        }


def _text(props: dict[bytes, bytes | None], key: str, limit: int = 64) -> str:
    raw = props.get(key.encode())
    if raw is None:
        raise AdvertError(f"TXT key {key!r} is missing")
    try:
        v = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise AdvertError(f"TXT key {key!r} is not UTF-8") from None
    if not v or len(v) > limit:
        raise AdvertError(f"TXT key {key!r} must hold 1-{limit} characters")
    return v


def _number(props: dict[bytes, bytes | None], key: str, hi: float) -> float:
    v = _text(props, key, 24)
    try:
        x = float(v)
    except ValueError:
        raise AdvertError(f"TXT key {key!r} is not a number: {v!r}") from None
    if not 0 <= x <= hi:  # also refuses nan and inf
        raise AdvertError(f"TXT key {key!r} is out of range: {v!r}")
    return x


def parse_txt(props: dict[bytes, bytes | None], addresses: tuple[str, ...] = ()) -> Advert:
    """Validate an advertisement's TXT properties. Raises AdvertError for anything off."""
    node, cluster = _text(props, "id"), _text(props, "cl")
    if not ID_RE.match(node) or not ID_RE.match(cluster):
        raise AdvertError("node and cluster ids must be 1-64 letters, digits, '.', '_' or '-'")
    dev = _text(props, "dev", 200).split(",")
    if len(dev) > 16 or not all(KIND_RE.match(k) for k in dev):
        raise AdvertError(f"bad device kinds {dev!r}")
    state = _text(props, "st", 16)
    if state not in STATES:
        raise AdvertError(f"unknown throttle state {state!r}")
    port = _number(props, "port", 65535)
    if port < 1 or port != int(port):
        raise AdvertError(f"bad port {port!r}")
    return Advert(
        node=node,
        cluster=cluster,
        version=_text(props, "v", 32),
        devices=tuple(dev),
        mem_free=int(_number(props, "mem", MAX_MEM // MIB)) * MIB,
        score=_number(props, "score", MAX_SCORE),
        state=state,
        port=int(port),
        addresses=addresses,
        reason=_text(props, "why", 64) if props.get(b"why") else None,
        kv_pool=int(_number(props, "kv", MAX_MEM // MIB)) * MIB if props.get(b"kv") else 0,  # older agents: none
    )


def local_addresses(only: str | None = None) -> list[str]:
    """This machine's IPv4 addresses to advertise (loopback and link-local left out)."""
    if only:
        return [only]
    import ifaddr

    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                a = ipaddress.ip_address(ip.ip)
                if not (a.is_loopback or a.is_link_local):
                    out.append(ip.ip)
    return out


class Discovery:
    """Advertises ``me()`` and reports peers of ``cluster`` through ``on_peer`` / ``on_gone``."""

    def __init__(
        self,
        cluster: str,
        me: Callable[[], Advert],
        on_peer: Callable[[Advert], None],
        on_gone: Callable[[str], None],
        interface: str | None = None,
    ) -> None:
        self.cluster, self.me, self.on_peer, self.on_gone = cluster, me, on_peer, on_gone
        self.interface = interface
        self._azc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._txt: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._names: dict[str, str] = {}  # instance name -> node id
        self.rejected = 0

    def _service_info(self, ad: Advert) -> AsyncServiceInfo:
        from zeroconf.asyncio import AsyncServiceInfo

        addrs = [socket.inet_aton(a) for a in local_addresses(self.interface)]
        name, server = f"{ad.node}.{SERVICE}", f"{ad.node}.local."
        return AsyncServiceInfo(SERVICE, name, port=ad.port, properties=ad.txt(), addresses=addrs, server=server)

    async def async_start(self) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

        ifaces = [self.interface] if self.interface else None
        self._azc = AsyncZeroconf(interfaces=ifaces or _all(), ip_version=IPVersion.V4Only)
        ad = self.me()
        self._info = self._service_info(ad)
        self._txt = ad.txt()
        self._browser = AsyncServiceBrowser(self._azc.zeroconf, SERVICE, handlers=[self._on_change])
        await self._azc.async_register_service(self._info, cooperating_responders=True)

    async def async_update(self) -> None:
        """Re-announce if the TXT changed (throttle state, free memory, score)."""
        if self._azc is None or self._info is None:
            return
        ad = self.me()
        if ad.txt() == self._txt:
            return
        self._txt = ad.txt()
        self._info = self._service_info(ad)
        await self._azc.async_update_service(self._info)

    def _on_change(self, zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        from zeroconf import ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            node = self._names.pop(name, None)
            if node:
                self.on_gone(node)
            return
        t = asyncio.ensure_future(self._resolve(name))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo

        assert self._azc is not None
        info = AsyncServiceInfo(SERVICE, name)
        if not await info.async_request(self._azc.zeroconf, 3000):
            log.debug("no answer resolving %s", name)
            return
        try:
            ad = parse_txt(dict(info.properties or {}), tuple(info.parsed_addresses(IPVersion.V4Only)))
        except AdvertError as e:
            self.rejected += 1
            log.warning("ignored a malformed advertisement %s: %s", name, e)
            return
        if ad.cluster != self.cluster:
            self.rejected += 1
            log.info("ignored %s: cluster %s is not ours (%s)", ad.node, ad.cluster, self.cluster)
            return
        if info.port != ad.port or not ad.addresses:
            self.rejected += 1
            log.warning("ignored %s: its port or addresses do not match its TXT", name)
            return
        if ad.node == self.me().node:
            return
        self._names[name] = ad.node
        self.on_peer(ad)

    async def async_close(self) -> None:
        resolving = list(self._tasks)
        for t in resolving:
            t.cancel()
        await asyncio.gather(*resolving, return_exceptions=True)
        if self._azc is None:
            return
        if self._browser is not None:
            with contextlib.suppress(Exception):
                await self._browser.async_cancel()
        if self._info is not None:
            with contextlib.suppress(Exception):
                goodbye = await self._azc.async_unregister_service(self._info)
                # sent before the sockets close (3 packets 125 ms apart; the first is what counts)
                await asyncio.wait_for(goodbye, GOODBYE_S)
        await self._azc.async_close()
        self._azc = None


def _all() -> list[str]:
    """Interfaces to run mDNS on: every IPv4 address we would advertise (not loopback)."""
    return local_addresses() or ["127.0.0.1"]
