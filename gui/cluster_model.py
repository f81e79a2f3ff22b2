"""Settings' "Model the cluster serves": one choice for the whole cluster, whichever laptop is elected.

Filled from the local agent (``GET /v1/cluster/model``): the registry's models and this laptop's
store's, those not pulled yet marked "downloads when served"; the weights; an optional draft
model (or prompt lookup) for speculative decoding. Saving ``PUT``s it: the agent checks the name
against its registry and store (an unknown one is refused with the agent's own one-line error,
shown here), signs the setting and every member adopts it within seconds. When this laptop has
its own ``serve.model`` in config.yaml, that override wins when it coordinates, and the picker
says so.

"Pull another…" lists the registry's models this laptop's store lacks; choosing one asks the agent
to pull it (``POST /v1/models/pull``) and follows its progress (``GET /v1/models/pulls``) in a
bar under the picker, which then offers the model as pulled. A pull goes on in the agent when the
dialog closes; opening Settings again shows it still running.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from PySide6.QtWidgets import QComboBox, QFormLayout, QLabel, QMenu, QProgressBar, QPushButton, QWidget

from gui.client import ApiError, Client, Unreachable

DEFAULT_WEIGHTS = "the model's default"
NO_DRAFT = "none"
CHOOSE = "choose a model…"
LOOKUP = "lookup"
PULL_POLL_S = 0.5  # how often a pull's progress is read from the agent


class ClusterModelPicker(QWidget):
    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client
        self.loaded: dict[str, Any] | None = None  # the agent's last answer
        self.model = QComboBox()
        self.weights = QComboBox()
        self.draft = QComboBox()
        self.current = QLabel("")
        self.current.setWordWrap(True)
        self.override = QLabel("")
        self.override.setWordWrap(True)
        self.pull_button = QPushButton("Pull another…")
        self.pull_menu = QMenu(self.pull_button)
        self.pull_button.setMenu(self.pull_menu)
        self.pull_bar = QProgressBar()
        self.pull_bar.setRange(0, 100)
        self.pull_bar.setVisible(False)
        self.pull_status = QLabel("")
        self.pull_status.setWordWrap(True)
        form = QFormLayout(self)
        form.addRow("Model the cluster serves", self.model)
        form.addRow("Weights", self.weights)
        form.addRow("Draft (speculative)", self.draft)
        form.addRow("", self.current)
        form.addRow("", self.override)
        form.addRow("Download", self.pull_button)
        form.addRow("", self.pull_bar)
        form.addRow("", self.pull_status)
        self.pulling: str | None = None  # the model whose pull is followed
        self._pull_task: asyncio.Task[None] | None = None
        self.setEnabled(False)

    # -- loading ---------------------------------------------------------------------------------
    async def async_load(self) -> None:
        try:
            st = await self.client.cluster_model()
        except (ApiError, Unreachable) as e:
            self.loaded = None
            self.setEnabled(False)
            self.current.setText(f"the cluster's model cannot be read: {e}")
            self.override.setText("")
            return
        self.fill(st)
        try:
            running = [p for p in await self.client.pulls() if p.get("state") == "pulling"]
        except (ApiError, Unreachable):
            running = []  # an older agent, or gone since: no pull to follow
        if running and self.pulling is None:
            self._follow(str(running[0]["model"]))

    def fill(self, st: dict[str, Any]) -> None:
        self.loaded = st
        models = [m for m in st.get("models") or [] if isinstance(m, dict) and m.get("name")]
        cluster = st.get("cluster") or {}
        self.model.clear()
        if not cluster:
            self.model.addItem(CHOOSE, None)
        for m in models:
            self.model.addItem(_label(m), m["name"])
        if cluster and self.model.findData(cluster.get("model")) < 0:  # set on a laptop that has it
            self.model.addItem(f"{cluster['model']} (not in this laptop's store)", cluster["model"])
        self.weights.clear()
        self.weights.addItem(DEFAULT_WEIGHTS, None)
        for w in st.get("weights") or []:
            self.weights.addItem(str(w), str(w))
        self.draft.clear()
        self.draft.addItem(NO_DRAFT, None)
        self.draft.addItem("prompt lookup", LOOKUP)
        for m in models:
            self.draft.addItem(_label(m), m["name"])
        _pick(self.model, cluster.get("model"))
        _pick(self.weights, cluster.get("weights"))
        _pick(self.draft, cluster.get("draft"))
        if cluster:
            self.current.setText(f"now: {cluster['model']} ({cluster.get('label', '')})")
        else:
            self.current.setText("no model chosen for the cluster yet: pick one and save")
        over = st.get("override") or {}
        if over.get("model"):
            self.override.setText(
                f"this laptop overrides it with {over['model']} (serve.model in config.yaml): "
                "that is what it serves when it is elected"
            )
        else:
            self.override.setText("")
        self._fill_pull_menu(models)
        self.setEnabled(bool(models))

    # -- pulling another model -------------------------------------------------------------------
    def _fill_pull_menu(self, models: list[dict[str, Any]]) -> None:
        self.pull_menu.clear()
        missing = [m for m in models if not m.get("pulled") and m.get("source", "registry") == "registry"]
        for m in missing:
            size = f" ({m['size'] / 1e6:.0f} MB)" if isinstance(m.get("size"), int | float) else ""
            act = self.pull_menu.addAction(f"{m['name']}{size}: {m.get('description') or ''}".rstrip(": "))
            act.setData(m["name"])
            act.triggered.connect(lambda _=False, name=m["name"]: self.pull(name))
        self.pull_button.setEnabled(bool(missing) and self.pulling is None)
        self.pull_button.setToolTip(
            "download a model of the registry into this laptop's store"
            if missing
            else "this laptop's store holds every model the registry offers"
        )

    def pull(self, model: str) -> None:
        """Start pulling ``model`` (the menu's choice) and follow it."""
        self._pull_task = asyncio.ensure_future(self.async_pull(model))

    async def async_pull(self, model: str) -> None:
        self.pull_button.setEnabled(False)
        self.pull_bar.setVisible(True)
        self.pull_bar.setValue(0)
        self.pull_status.setStyleSheet("")
        self.pull_status.setText(f"pulling {model}: asking the agent…")
        try:
            st = await self.client.pull_model(model)
        except (ApiError, Unreachable) as e:
            self._pull_ended(model, f"{model} cannot be pulled: {e}", failed=True)
            return
        if st.get("state") == "done":
            await self._pulled(model)
            return
        self.pulling = model
        await self._watch(model)

    def _follow(self, model: str) -> None:
        """Follow a pull already running in the agent (Settings opened again while it runs)."""
        self.pulling = model
        self.pull_button.setEnabled(False)
        self.pull_bar.setVisible(True)
        self.pull_status.setText(f"pulling {model}…")
        self._pull_task = asyncio.ensure_future(self._watch(model))

    async def _watch(self, model: str) -> None:
        misses = 0
        while True:
            await asyncio.sleep(PULL_POLL_S)
            try:
                pulls = {str(p["model"]): p for p in await self.client.pulls()}
                misses = 0
            except (ApiError, Unreachable) as e:
                misses += 1
                if misses >= 10:  # 5 s without the agent: say so, and let the user try again
                    self._pull_ended(model, f"the agent stopped answering while it pulled {model}: {e}", failed=True)
                    return
                continue
            p = pulls.get(model)
            if p is None:
                self._pull_ended(model, f"the agent no longer knows of a pull of {model} (restarted?)", failed=True)
                return
            pct = p.get("percent")
            if isinstance(pct, int | float):
                self.pull_bar.setRange(0, 100)
                self.pull_bar.setValue(int(pct))
            else:
                self.pull_bar.setRange(0, 0)  # busy, amount unknown
            if p.get("state") == "pulling":
                self.pull_status.setText(f"pulling {model}: {p.get('step') or ''}")
                continue
            if p.get("state") == "done":
                await self._pulled(model)
            else:
                self._pull_ended(model, f"pulling {model} failed: {p.get('error') or 'no reason given'}", failed=True)
            return

    async def _pulled(self, model: str) -> None:
        self.pulling = None
        await self.async_load()  # the store changed: the model is offered as pulled now
        if self.loaded is None:
            self._pull_ended(model, f"{model} is in this laptop's store")
            return
        _pick(self.model, model)  # pulled to be served: chosen, saved only by Save
        self._pull_ended(model, f"{model} is in this laptop's store and chosen above: Save to serve it")
        self.pull_bar.setVisible(True)
        self.pull_bar.setRange(0, 100)
        self.pull_bar.setValue(100)

    def _pull_ended(self, model: str, message: str, *, failed: bool = False) -> None:
        self.pulling = None
        with contextlib.suppress(RuntimeError):  # the dialog was deleted meanwhile
            self.pull_bar.setVisible(not failed)
            self.pull_status.setStyleSheet("color:#b91c1c" if failed else "")
            self.pull_status.setText(message + (": try again from Pull another…" if failed else ""))
            if self.loaded is not None:
                self._fill_pull_menu([m for m in self.loaded.get("models") or [] if isinstance(m, dict)])

    # -- saving ----------------------------------------------------------------------------------
    def choice(self) -> tuple[str | None, str | None, str | None]:
        return self.model.currentData(), self.weights.currentData(), self.draft.currentData()

    def changed(self) -> bool:
        """Whether the choice differs from the cluster's setting (nothing chosen yet: any choice)."""
        if self.loaded is None or not self.isEnabled():
            return False
        c = self.loaded.get("cluster") or {}
        if not c:
            return self.choice()[0] is not None  # the placeholder stays: nothing to save
        return self.choice() != (c.get("model"), c.get("weights"), c.get("draft"))

    async def async_save(self) -> str | None:
        """Set the cluster's model if the choice changed: the agent's message (None: unchanged).
        Raises :class:`ApiError` (the agent refused it) or :class:`Unreachable`."""
        if not self.changed():
            return None
        model, weights, draft = self.choice()
        assert model is not None
        st = await self.client.set_cluster_model(model, weights, draft)
        self.fill(st)
        return str(st.get("message") or f"the cluster serves {model}")


def _label(m: dict[str, Any]) -> str:
    return str(m["name"]) + ("" if m.get("pulled") else " (downloads when served)")


def _pick(box: QComboBox, value: Any) -> None:
    """Select ``value`` (added if the box lacks it, so that saving keeps it as it is)."""
    i = box.findData(value)
    if i < 0 and value is not None:
        box.addItem(str(value), value)
        i = box.count() - 1
    box.setCurrentIndex(max(i, 0))
