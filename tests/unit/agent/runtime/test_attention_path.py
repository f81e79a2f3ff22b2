"""Which attention path a device gets: paged where PagedAttention runs, stateful elsewhere."""

from __future__ import annotations

import pytest

from agent.runtime.paged import attention_path


@pytest.mark.parametrize(
    ("device", "override", "path"),
    [
        ("CPU", "", "paged"),
        ("GPU", "", "paged"),
        ("GPU.1", "", "paged"),
        ("NPU", "", "stateful"),  # the NPU plugin runs stateful models only
        ("CPU", "stateful", "stateful"),
        ("NPU", "Paged", "paged"),
        ("NPU", "auto", "stateful"),
        ("CPU", "auto", "paged"),
    ],
)
def test_attention_path(device: str, override: str, path: str) -> None:
    assert attention_path(device, override=override) == path


def test_a_misspelt_override_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAKESHARD_ATTENTION", "pagd")
    with pytest.raises(ValueError, match="LAKESHARD_ATTENTION must be auto, paged or stateful, not 'pagd'"):
        attention_path("CPU")
