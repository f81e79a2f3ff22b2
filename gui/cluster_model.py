"""Settings' "Model the cluster serves": one choice for the whole cluster, whichever laptop is elected.

Filled from the local agent (``GET /v1/cluster/model``): the registry's models and this laptop's
store's, those not pulled yet marked "downloads when served"; the weights; an optional draft
model (or prompt lookup) for speculative decoding. Saving ``PUT``s it: the agent checks the name
against its registry and store (an unknown one is refused with the agent's own one-line error,
shown here), signs the setting and every member adopts it within seconds. When this laptop has
its own ``serve.model`` in config.yaml, that override wins when it coordinates, and the picker
says so.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import QComboBox, QFormLayout, QLabel, QWidget

from gui.client import ApiError, Client, Unreachable

DEFAULT_WEIGHTS = "the model's default"
NO_DRAFT = "none"
CHOOSE = "choose a model…"
LOOKUP = "lookup"


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
        form = QFormLayout(self)
        form.addRow("Model the cluster serves", self.model)
        form.addRow("Weights", self.weights)
        form.addRow("Draft (speculative)", self.draft)
        form.addRow("", self.current)
        form.addRow("", self.override)
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
        self.setEnabled(bool(models))

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
