"""The coordinator's services on this node: running while it is the elected coordinator.

The election tells of every change of role or term (:attr:`agent.cluster.elector_state.ElectorState.on_change`),
the cluster settings of every newer document held; each wakes :meth:`Supervisor.run`, which stops
the services of a lost or older term, restarts them onto a newly chosen model, and starts them when
this node leads. A slow wake-up (``FALLBACK_S``) covers what tells no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from agent.cluster.election import Role
from agent.cluster.settings_gossip import Effective
from agent.common.config import ring_port_for
from agent.export import held as held_exports
from agent.node.roles import NoCoordinator, Services, ServicesFactory, ServicesSpec, load_factory
from agent.node.views import members, my_ip

if TYPE_CHECKING:
    from agent.node.daemon import AgentDaemon

log = logging.getLogger("agent.node.daemon")
FALLBACK_S = 2.0  # the longest the services wait to follow a change that woke no one


class Supervisor:
    def __init__(self, d: AgentDaemon) -> None:
        self.d = d
        self.wake = asyncio.Event()  # set on a change of role, term or the model to serve
        self._serving: tuple[str | None, str | None, str | None] | None = None  # the services' model
        self._warmed: tuple[str | None, str | None, str | None] | None = None  # its config read once

    def changed(self, *_: object) -> None:
        """A change that may move the services (callback of the election and the cluster settings)."""
        self.wake.set()

    async def run(self) -> None:
        d = self.d
        try:
            make_services = await asyncio.to_thread(load_factory)  # (imports torch: seconds, off the loop)
        except (NoCoordinator, ImportError) as err:
            d.no_services = str(err)
            log.error("this agent cannot coordinate: %s", err)
            return
        again = True
        while True:
            if not again:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), FALLBACK_S)
            self.wake.clear()
            again = await self._step(make_services)

    async def _step(self, make_services: ServicesFactory) -> bool:
        """One look at the election and the model; True to look again at once."""
        d = self.d
        e = d.elector
        assert e is not None
        leading = e.role is Role.COORDINATOR
        term = d.store.state.term
        want = d.effective_model()
        sv = d.services
        moved = sv is not None and leading and sv.term == term and self._serving != want.key
        if moved:  # a newer cluster setting was adopted (or set here): re-plan onto its model
            log.info("the model to serve is now %s (%s): the services restart", want.model or "none", want.why)
        if sv is not None and (not leading or sv.term != term or moved):
            log.info("coordinator services stop (term %d)", sv.term)
            await sv.async_stop()
            d.services = None
        if want.model and want.key != self._warmed:
            # the first read of a model's config (and tokenizer) imports transformers' code for
            # it: seconds, on a busy laptop enough to miss beats and lose the election, so off the
            # loop, and on every member ahead of time, so that taking over never waits for it
            self._warmed = want.key
            await asyncio.to_thread(_read_config, want.model, d.held)
            return True  # (still the coordinator, of the same term? look again)
        if leading and d.services is None:
            self._serving = want.key
            d.services = await self._async_start(make_services, term, want)
        return False

    async def _async_start(self, make_services: ServicesFactory, term: int, want: Effective) -> Services:
        d, s = self.d, self.d.settings
        services = make_services(
            ServicesSpec(
                model=want.model,
                weights=want.weights,
                draft=want.draft,
                name=d.display_name(),
                api_port=s.serve_api_port,
                ring_port=s.serve_ring_port if s.serve_ring_port is not None else ring_port_for(d.me.port),
                streams=s.serve_streams,
                min_nodes=s.serve_min_nodes,
                api_rate=s.serve_api_rate,
                api_concurrency=s.serve_api_concurrency,
                exact=s.serve_exact,
                term=term,
                my_address=f"{my_ip(d)}:{d.me.port}",
                members=lambda: members(d),
                nodes=d.node_infos,
                cluster=s.cluster_id,
                needed_before=lambda: d.copies.cluster_needs,
                transport=d.transport,
            )
        )
        await services.async_start()
        return services


def _read_config(model: str, held: held_exports.HeldExports) -> None:
    """Read a model's config once, from the store or from an export of it held here, and load the
    tokenizer's code (in a worker thread: see :meth:`Supervisor._step`); failures are the
    coordinator services' to report."""
    from agent.models.store import LocalModel, ModelStore

    with contextlib.suppress(Exception):
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (the coordinator loads both)

        m = ModelStore().get(model)
        if m is None:
            found = [h.dir for h in held.scan().values() if h.rel.startswith(f"{model}-")]
            m = LocalModel.from_export(found[0]) if found else None
        if m is not None:
            m.config()
