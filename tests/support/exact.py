"""Coordinator settings whose outputs compare token for token with the whole model's."""

from __future__ import annotations

from typing import Any


def exact_config(model: Any, nodes: list[str], term: int, **kw: Any) -> Any:
    """A coordinator config whose outputs compare token for token: INT8 weights, f32 all through."""
    from agent.export.exporter import ExportOptions
    from agent.security.transport import PLAINTEXT
    from coordinator.service.config import ServeConfig

    return ServeConfig(
        nodes=nodes,
        model=model,
        opts=ExportOptions(weights="int8"),
        transport=PLAINTEXT,  # the lab clusters of these tests are plaintext
        exact=True,
        wire_dtype="f32",
        api=False,
        quiet=True,
        term=term,
        **kw,
    )
