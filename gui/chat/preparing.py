"""The chat window's word on a coordinator that prepares its model (before its first answer),
or that cannot be reached (:func:`unreachable`).

The coordinator's API answers only once the model is ready; until then the local agent says
``not_serving`` with the step it is at, and the cluster's event stream carries each step as it
happens (:class:`agent.protocol.cluster_view.Preparation`). :func:`banner` words it for the user
(pure); :func:`async_follow` keeps the window's picture of it current.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agent.protocol.cluster_view import ClusterView, Preparation
from agent.protocol.events import apply_event
from gui.client import Client

log = logging.getLogger(__name__)
# the banner's kinds (its colours come from the palette: :meth:`gui.chat.theme.Theme.banner_style`)
INFO = "info"
WARN = "warn"
ERROR = "error"
RECONNECT_S = 2.0
LONG = "(A model's first start can take several minutes; later starts reuse its stages.)"


def banner(p: Preparation | None, said: str | None, pending: bool) -> tuple[str, str, float | None]:
    """The banner's text and kind (INFO, WARN or ERROR), and the progress bar's percent (None:
    no bar), while the coordinator cannot answer yet: from its preparation ``p`` when the event
    stream told it, else from what its API ``said`` (pure)."""
    then = " Your message will be sent then." if pending else ""
    if p is not None and p.step == "failed":
        text = (
            f"The coordinator could not prepare {p.model}: {p.error}\n"
            "Its log says more (tray menu: Open logs folder); fix the cause and restart its agent."
        )
        return text, ERROR, None
    if p is not None and p.step != "ready":
        text = f"Preparing {p.model}: {p.describe()}\nThe chat answers once the model is ready.{then} {LONG}"
        return text, INFO, p.percent
    why = (said or "the coordinator is not ready yet").strip()
    return f"{why[:1].upper()}{why[1:]}.\nThe chat answers once it is ready.{then}", INFO, None


def unreachable(why: str, bad_address: bool, pending: bool, retry_s: float) -> str:
    """The banner's text when no coordinator answers (``why``: what the client said; it names
    the wrong address when ``bad_address``), retried every ``retry_s`` (pure)."""
    if bad_address:  # (``why`` says what is wrong with it)
        extra = " Your message will be sent once it works." if pending else ""
        return (
            f"{why[:1].upper()}{why[1:]}.\nCorrect it in Settings (Chat tab), or leave it blank to chat "
            f"through this laptop's agent.{extra}"
        )
    extra = " Your message will be sent when one answers." if pending else ""
    head = "No coordinator is reachable right now"
    if why.lower().startswith(head.lower()):  # the agent's own words say it: once is enough
        head, why = f"{head}{why[len(head) :].split(';')[0]}", ""
    return f"{head}; retrying every {retry_s:.0f} s.{extra}" + (f"\n{why}" if why else "")


async def async_follow(client: Client, on_view: Callable[[ClusterView | None], None]) -> None:
    """The cluster as its event stream tells it, to ``on_view`` after each event; reconnects
    after a break, until cancelled."""
    while True:
        view: ClusterView | None = None
        try:
            async for ev in client.events():
                view = apply_event(view, ev)
                on_view(view)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # (unreachable, a malformed event): try again shortly
            log.debug("cluster event stream: %s", e)
        on_view(None)
        await asyncio.sleep(RECONNECT_S)
