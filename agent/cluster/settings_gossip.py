"""The cluster settings this node holds, and their gossip: every member comes to hold the newest.

A member sets them through its local API (:meth:`SettingsGossip.async_set`: the next version,
signed with its node key in a secured cluster, written to ``cluster_settings.json`` in the config
folder). Every beat announces the held document's ``(version, set_by)`` (``Beat.settings``); a
member that hears of a higher one fetches it (``GET /v1/cluster/settings`` on the peer's data
port, mutual TLS in a secured cluster, see :mod:`agent.cluster.gossip`), checks it off the event loop
(:func:`agent.cluster.settings.check`: this cluster's, signed by the member it names, whose
certificate is the CA's, valid and not revoked) and adopts it: written atomically, then held.
A document that fails is refused with a WARNING (rate-limited) and counted under
``cluster_settings`` in ``/v1/cluster``; the one held stays.

The document is loaded (and checked again) at start. A document whose setter is revoked is
refused everywhere: when offered, at start, and when the revocation list this node holds comes
to name its setter (it is then dropped, with a WARNING saying to choose the model again), so all
members end on the same answer. :class:`Effective` says what this node would serve if elected:
its own override (``serve.model`` in config.yaml, or ``--serve-model``), else the cluster's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.cluster import settings as cs
from agent.cluster.gossip import DocumentGossip
from agent.cluster.settings import ClusterSettings, SettingsError
from agent.protocol import Beat
from agent.security.transport import Transport

log = logging.getLogger(__name__)
PATH = "/v1/cluster/settings"
REFRESH_S = 2.0  # how often the held document's setter is checked against the revocation list
CHOOSE_HINT = "choose the cluster's model in Settings (or `lakeshard cluster model NAME`)"
OVERRIDE_WHY = "this laptop's override (serve.model in config.yaml)"


@dataclass(frozen=True)
class Effective:
    """The model this node serves when it is elected coordinator, and why."""

    model: str | None
    weights: str | None = None
    draft: str | None = None
    source: str | None = None  # "override", "cluster", or None (no model)
    why: str = f"no model chosen: {CHOOSE_HINT}"

    @property
    def key(self) -> tuple[str | None, str | None, str | None]:
        return self.model, self.weights, self.draft

    @property
    def override(self) -> bool:
        return self.source == "override"

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "weights": self.weights,
            "draft": self.draft,
            "source": self.source,
            "override": self.override,
            "why": self.why,
        }


def effective(override: str | None, override_weights: str | None, held: ClusterSettings | None) -> Effective:
    """This node's own ``serve.model`` if set, else the cluster setting, else none."""
    if override:
        return Effective(override, override_weights, None, "override", OVERRIDE_WHY)
    if held is not None:
        return Effective(held.model, held.weights, held.draft, "cluster", held.label())
    return Effective(None)


class SettingsGossip(DocumentGossip):
    """Holds this node's cluster settings; fetches and adopts the newer ones peers announce."""

    WHAT = "the cluster settings"
    PATH = PATH
    MAX_BYTES = cs.MAX_BYTES

    def __init__(
        self,
        transport: Transport,
        cluster: str,
        node: str,
        folder: Path | None = None,
        on_change: Callable[[ClusterSettings | None], None] | None = None,
    ) -> None:
        super().__init__(transport, log)
        self.cluster = cluster
        self.node = node  # the setter's id in a plaintext cluster (a secured one: the certificate's)
        self.file = cs.path(folder)
        self.held: ClusterSettings | None = None
        self.highest = 0  # the highest version heard of (held, announced, or dropped)
        self.on_change = on_change
        self._lock = threading.Lock()  # the file and ``held``: written from worker threads
        self._revocation = self._revocation_version()

    @property
    def creds(self) -> Any:
        return self.transport.creds

    def _revocation_version(self) -> int:
        return self.creds.revocation_version if self.creds is not None else -1

    # -- at start --------------------------------------------------------------------------------
    def load(self) -> ClusterSettings | None:
        """Take the document on disk, if there is one and it checks out (a refusal is logged)."""
        try:
            doc = cs.load(self.file)
            if doc is None:
                return None
            self.highest = max(self.highest, doc.version)
            doc = cs.check(doc, self.cluster, self.creds)
        except SettingsError as e:
            log.warning("the cluster settings on disk are not used: %s", e)
            return None
        self.held = doc
        log.info("%s: the cluster serves %s", doc.label(), _what(doc))
        self._changed()
        return doc

    def announce(self) -> tuple[int, str] | None:
        """What this node's beats say it holds."""
        return self.held.key if self.held is not None else None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.held)

    # -- beats -----------------------------------------------------------------------------------
    def on_beat(self, beat: Beat, src: tuple[str, int]) -> None:
        """A beat taken by the elector: fetch its sender's settings if they are newer."""
        offered = beat.settings
        if offered is None:
            return
        self.highest = max(self.highest, offered[0])
        if self.held is None or offered > self.held.key:
            self.want(src, beat.port, beat.node, offered)

    def describe(self, offered: Any) -> str:
        return f"v{offered[0]} by node {offered[1]}" if isinstance(offered, tuple) else "(unannounced)"

    async def take(self, data: bytes, node: str, offered: Any = None) -> bool:
        """Adopt the document in ``data`` (from node ``node``) if it checks out and is newer than
        the one held; checked and written off the event loop."""
        try:
            doc = await asyncio.to_thread(self._adopt, data)
        except (SettingsError, OSError) as e:
            self.refused += 1
            self.failed_because(f"refused the cluster settings {self.describe(offered)} from node {node}: {e}")
            return False
        held = self.held
        if doc is None and offered is not None and (held is None or tuple(offered) > held.key):
            self.refused += 1  # it announced a document it does not serve: not again at once
            self.failed_because(f"node {node} announced cluster settings {self.describe(offered)} but served others")
            return False
        self.succeeded()
        if doc is None:
            return False
        self.adopted += 1
        log.info("%s from node %s: the cluster serves %s", doc.label(), node, _what(doc))
        self._changed()
        return True

    def _adopt(self, data: bytes) -> ClusterSettings | None:
        doc = cs.check(cs.parse(data), self.cluster, self.creds)
        with self._lock:
            if not cs.newer(self.held, doc):
                return None
            cs.save(self.file, doc)
            self.held = doc
            self.highest = max(self.highest, doc.version)
        return doc

    # -- setting them here -----------------------------------------------------------------------
    async def async_set(
        self, model: str, weights: str | None, draft: str | None, name: str | None = None
    ) -> ClusterSettings:
        """A new document (the next version), signed in a secured cluster, written and held: the
        next beat announces it. Its fields are checked (:func:`agent.cluster.settings.make`)."""

        def write() -> ClusterSettings:
            with self._lock:
                version = max(self.highest, self.held.version if self.held else 0) + 1
                doc = cs.make(self.cluster, version, model, weights, draft, self.node, name, self.creds)
                cs.save(self.file, doc)
                self.held, self.highest = doc, version
            return doc

        doc = await asyncio.to_thread(write)
        log.info("%s set here: the cluster serves %s", doc.label(), _what(doc))
        self._changed()
        return doc

    # -- revocations -----------------------------------------------------------------------------
    def check_setter(self) -> bool:
        """Drop the held document if the revocation list now names its setter; whether it did."""
        v = self._revocation_version()
        if v == self._revocation:
            return False
        self._revocation = v
        doc = self.held
        if doc is None or self.creds is None or not self.creds.is_revoked(doc.set_by):
            return False
        with self._lock:
            if self.held is doc:
                self.held = None
        log.warning(
            "%s: node %s, which set it, is revoked, so the setting no longer holds: %s",
            doc.label(),
            doc.set_by,
            CHOOSE_HINT,
        )
        self._changed()
        return True

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(REFRESH_S)
                self.check_setter()
        finally:
            await self.async_stop()

    def status(self) -> dict[str, Any]:
        doc = self.held
        held = None if doc is None else {k: v for k, v in doc.fields().items() if k != "cluster"}
        return {"held": held, "signed": bool(doc and doc.signed), "highest_version": self.highest, **self.counters()}


def _what(doc: ClusterSettings) -> str:
    extra = [f"weights {doc.weights}"] if doc.weights else []
    if doc.draft:
        extra.append(f"draft {doc.draft}")
    return doc.model + (f" ({', '.join(extra)})" if extra else "")
