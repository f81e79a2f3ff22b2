"""An agent's answer to its assignment says what a paged stage holds (the micro-batching
scheduler plans with it); an older agent's answer, without those fields, still parses."""

from __future__ import annotations

import pytest

from agent.protocol import Assigned, ProtocolError, decode, encode


def test_a_paged_stage_answer_round_trips_with_its_pool() -> None:
    a = Assigned(term=3, stage=1, device="CPU", compile_s=1.5, kv_blocks=640, block_tokens=32, step_tokens=2048)
    got, _ = decode(encode(a))
    assert got == a and isinstance(got, Assigned) and got.paged


def test_a_stateful_or_older_agent_answer_has_no_pool() -> None:
    old = {"t": "assigned", "term": 3, "stage": 0, "device": "CPU", "compile_s": 0.2}
    got = Assigned.parse(old)
    assert not got.paged and got.kv_blocks is None and got.step_tokens is None


@pytest.mark.parametrize("field,value", [("kv_blocks", 0), ("block_tokens", -1), ("step_tokens", "many")])
def test_a_bad_pool_figure_is_refused(field: str, value: object) -> None:
    h = {"t": "assigned", "term": 3, "stage": 0, "device": "CPU", "compile_s": 0.2, field: value}
    with pytest.raises(ProtocolError):
        Assigned.parse(h)
