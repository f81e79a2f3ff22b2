"""What a node's mDNS advert says, and what a listener reads back from it."""

from __future__ import annotations

import pytest

from agent.cluster.discovery import MIB, Advert, AdvertError, parse_txt
from agent.runtime.kv_budget import kv_pool_bytes

GIB = 1 << 30


def _txt(a: Advert) -> dict[bytes, bytes | None]:
    return {k.encode(): v.encode() for k, v in a.txt().items()}


def test_the_advert_says_what_kv_pool_a_stage_would_get() -> None:
    a = Advert("n1", "office", "0.1", ("CPU", "GPU"), 3 * GIB, 42.0, "available", 7700, ("10.0.0.5",))
    back = parse_txt(_txt(a), a.addresses)
    assert back.kv_pool == kv_pool_bytes(3 * GIB) == 768 * MIB
    assert (back.node, back.mem_free, back.devices, back.port) == ("n1", 3 * GIB, ("CPU", "GPU"), 7700)


def test_an_older_agents_advert_without_it_still_parses() -> None:
    a = Advert("n1", "office", "0.1", ("CPU",), 3 * GIB, 42.0, "available", 7700)
    props = _txt(a)
    del props[b"kv"]
    assert parse_txt(props).kv_pool == 0


@pytest.mark.parametrize("bad", [b"-1", b"lots", b"nan", b"1e30"])
def test_a_bad_kv_figure_is_refused(bad: bytes) -> None:
    props = _txt(Advert("n1", "office", "0.1", ("CPU",), GIB, 1.0, "available", 7700))
    props[b"kv"] = bad
    with pytest.raises(AdvertError, match="kv"):
        parse_txt(props)
