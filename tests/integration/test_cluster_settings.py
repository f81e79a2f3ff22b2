"""The cluster settings document (issue 37): which model the cluster serves, signed by the member
that set it, ordered by (version, set_by), and gossiped. What any member is handed is checked: a
tampered field, another cluster, a revoked or impersonated setter, an unsigned document in a
secured cluster, garbage and oversized documents are refused, and never replace the one held.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent.api.cluster_model import validate
from agent.cluster import settings as cs
from agent.cluster.settings import ClusterSettings, SettingsError
from agent.cluster.settings_gossip import SettingsGossip, effective
from agent.protocol import Beat, DeviceOffer, Sealed, decode, encode
from agent.protocol.control import MAX_BODY
from agent.security import cluster, files
from agent.security.credentials import Credentials
from agent.security.datagrams import Signed
from agent.security.transport import Transport
from tests.support.members import make_member

ME, PEER, OTHER = "0b0b0b0b0b0b", "0c0c0c0c0c0c", "0e0e0e0e0e0e"


@pytest.fixture
def members(tmp_path: Path) -> dict[str, Any]:
    ca_dir = files.security_dir(tmp_path / "ca")
    cluster.init_cluster("0a0a0a0a0a0a", ca_dir)
    return {
        "ca_dir": ca_dir,
        "me": make_member(ca_dir, files.security_dir(tmp_path / "me"), ME),
        "peer": make_member(ca_dir, files.security_dir(tmp_path / "peer"), PEER),
        "other": make_member(ca_dir, files.security_dir(tmp_path / "other"), OTHER),
        "outsider": cluster.init_cluster("0d0d0d0d0d0d", files.security_dir(tmp_path / "outsider")),
    }


def _doc(
    creds: Credentials, version: int = 2, model: str = "smollm2-135m", weights: str = "int8", draft: str | None = None
) -> ClusterSettings:
    return cs.make(creds.cluster_id, version, model, weights, draft, "ignored", "bob", creds)


def _bad_docs(m: dict[str, Any]) -> dict[str, bytes]:
    me, peer, outsider = m["me"], m["peer"], m["outsider"]
    good = _doc(peer)
    j = good.to_json()
    other_cluster = _doc(outsider)
    foreign_ca_our_id = json.dumps(dict(other_cluster.to_json(), cluster=me.cluster_id)).encode()
    # signed by peer (its certificate and signature over this very body), another member named
    unsigned = replace(good, set_by=OTHER, cert=None, signature=None)
    wrong_setter = replace(unsigned, cert=peer.node_cert_der, signature=peer.sign(unsigned.body())).to_json()
    return {
        "model changed, signature kept": json.dumps(dict(j, model="qwen2.5-coder-1.5b")).encode(),
        "version bumped, signature kept": json.dumps(dict(j, version=9)).encode(),
        "weights changed, signature kept": json.dumps(dict(j, weights="fp32")).encode(),
        "draft added, signature kept": json.dumps(dict(j, draft="lookup")).encode(),
        "setter's name changed, signature kept": json.dumps(dict(j, set_by_name="mallory")).encode(),
        "another member named as setter": json.dumps(wrong_setter).encode(),
        "another cluster's document": json.dumps(other_cluster.to_json()).encode(),
        "another CA's signer, our cluster id": foreign_ca_our_id,
        "unsigned, in a secured cluster": json.dumps(dict(j, cert=None, signature=None)).encode(),
        "a path for a model": json.dumps(dict(j, model="/etc/passwd")).encode(),
        "weights unknown": json.dumps(dict(j, weights="int3")).encode(),
        "version 0": json.dumps(dict(j, version=0)).encode(),
        "not JSON": b"\x00settings",
        "a JSON list": b"[1, 2]",
        "too large": json.dumps(dict(j, pad="x" * cs.MAX_BYTES)).encode(),
    }


BAD = {  # case: why it is refused
    "model changed, signature kept": "signature is not node 0c0c0c0c0c0c's",
    "version bumped, signature kept": "signature is not node 0c0c0c0c0c0c's",
    "weights changed, signature kept": "signature is not node 0c0c0c0c0c0c's",
    "draft added, signature kept": "signature is not node 0c0c0c0c0c0c's",
    "setter's name changed, signature kept": "signature is not node 0c0c0c0c0c0c's",
    "another member named as setter": "name node 0e0e0e0e0e0e as their setter, but node 0c0c0c0c0c0c signed them",
    "another cluster's document": "not this one's",
    "another CA's signer, our cluster id": "signature is refused",
    "unsigned, in a secured cluster": "not signed, and this cluster is a secured one",
    "a path for a model": "model must be a model name",
    "weights unknown": "weights must be one of",
    "version 0": "no version number",
    "not JSON": "not JSON",
    "a JSON list": "not a JSON object",
    "too large": "at most 16384",
}


def test_a_signed_document_checks_out_anywhere_in_its_cluster(members: dict[str, Any]) -> None:
    me, peer = members["me"], members["peer"]
    doc = _doc(peer, draft=None)
    assert doc.signed and doc.set_by == PEER and doc.label() == "cluster setting v2 by bob"
    back = cs.check(cs.parse(json.dumps(doc.to_json()).encode()), me.cluster_id, me)
    assert back == doc


@pytest.mark.parametrize("case", BAD)
def test_a_bad_document_is_refused(members: dict[str, Any], case: str) -> None:
    me = members["me"]
    with pytest.raises(SettingsError, match=BAD[case]):
        cs.check(cs.parse(_bad_docs(members)[case]), me.cluster_id, me)


def test_a_revoked_setter_is_refused(members: dict[str, Any]) -> None:
    me, peer = members["me"], members["peer"]
    data = json.dumps(_doc(peer).to_json()).encode()
    cs.check(cs.parse(data), me.cluster_id, me)
    cluster.revoke(PEER, members["ca_dir"])
    assert me.adopt((members["ca_dir"] / files.REVOKED).read_bytes())
    with pytest.raises(SettingsError, match="revoked"):
        cs.check(cs.parse(data), me.cluster_id, me)


def test_a_plaintext_cluster_takes_unsigned_documents_of_its_own_cluster() -> None:
    doc = cs.make("office", 1, "smollm2-135m", None, "lookup", "28a9cc016ce1")
    assert not doc.signed
    assert cs.check(cs.parse(json.dumps(doc.to_json()).encode()), "office", None) == doc
    with pytest.raises(SettingsError, match="cluster office's, not this one's"):
        cs.check(doc, "default", None)


@pytest.mark.parametrize(
    ("held", "offered", "newer"),
    [
        (None, (1, "aaaaaaaaaaaa"), True),
        ((1, "aaaaaaaaaaaa"), (2, "aaaaaaaaaaaa"), True),
        ((2, "aaaaaaaaaaaa"), (1, "ffffffffffff"), False),  # the version counts first
        ((3, "aaaaaaaaaaaa"), (3, "bbbbbbbbbbbb"), True),  # set at once on two laptops: the higher id wins
        ((3, "bbbbbbbbbbbb"), (3, "aaaaaaaaaaaa"), False),  # ... everywhere
        ((3, "bbbbbbbbbbbb"), (3, "bbbbbbbbbbbb"), False),  # the one held
    ],
)
def test_order_is_version_then_setter(held: tuple[int, str] | None, offered: tuple[int, str], newer: bool) -> None:
    def doc(k: tuple[int, str]) -> ClusterSettings:
        return cs.make("office", k[0], "smollm2-135m", None, None, k[1])

    assert cs.newer(doc(held) if held else None, doc(offered)) is newer


@pytest.mark.parametrize(
    ("override", "held", "want"),
    [
        (None, None, (None, None, None)),
        (None, (4, "smollm2-135m"), ("smollm2-135m", "int8", "cluster")),
        ("qwen2.5-coder-0.5b", (4, "smollm2-135m"), ("qwen2.5-coder-0.5b", "fp16", "override")),
        ("qwen2.5-coder-0.5b", None, ("qwen2.5-coder-0.5b", "fp16", "override")),
    ],
)
def test_the_override_comes_first(override: str | None, held: tuple[int, str] | None, want: tuple[Any, ...]) -> None:
    doc = cs.make("office", held[0], held[1], "int8", None, "28a9cc016ce1", "alice") if held else None
    e = effective(override, "fp16" if override else None, doc)
    assert (e.model, e.weights, e.source) == want
    if want[2] == "cluster":
        assert e.why == "cluster setting v4 by alice"
    elif want[2] == "override":
        assert e.why == "this laptop's override (serve.model in config.yaml)"
    else:
        assert "choose the cluster's model in Settings" in e.why


MODELS = [{"name": "smollm2-135m"}, {"name": "qwen2.5-coder-0.5b"}, {"name": "mine"}]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"model": "smollm2-135m", "weights": "int8"}, None),
        ({"model": "mine", "draft": "lookup"}, None),
        ({"model": "smollm2-135m", "draft": "qwen2.5-coder-0.5b+lookup"}, None),
        ({"model": "nope"}, "unknown model 'nope': choose one of smollm2-135m, qwen2.5-coder-0.5b, mine"),
        ({"model": "smollm2-135m", "draft": "nope"}, "unknown draft 'nope'"),
        ({"model": "smollm2-135m", "weights": "int3"}, "weights must be one of fp32, fp16, int8, int4"),
        ({"model": "../../etc/passwd"}, "unknown model"),
        ({"model": ""}, "give the model"),
        ({"model": "smollm2-135m", "serve": 1}, "unknown field(s): serve"),
        (["smollm2-135m"], "the body must be a JSON object"),
    ],
)
def test_what_a_laptop_may_set(body: Any, error: str | None) -> None:
    if error is None:
        assert validate(body, MODELS)[0] == body["model"]
    else:
        with pytest.raises(SettingsError, match=error.replace("(", r"\(").replace(")", r"\)")):
            validate(body, MODELS)


# -- beats ---------------------------------------------------------------------------------------


def _beat(node: str, port: int, settings: tuple[int, str] | None, offers: int = 0) -> Beat:
    offer = DeviceOffer("GPU.1", 1234.5, 1 << 40, True)
    return Beat(
        "np5xbiyjt33tgif6u3my43atde",
        node,
        port,
        12,
        "coordinator",
        node,
        "available",
        True,
        1.0,
        1 << 40,
        1 << 41,
        ("CPU", "GPU"),
        "0.1.0",
        name="a-host-name-of-some-length.example.org",
        reason="user",
        temp_c=71.5,
        tok_s=88.8,
        next_rtt_ms=1.25,
        offers=(offer,) * offers,
        revocation=12,
        settings=settings,
    )


def test_beats_announce_the_settings_held_within_a_sealed_datagram(members: dict[str, Any]) -> None:
    b = _beat(PEER, 7700, (123456, PEER), offers=8)
    back = decode(encode(b))[0]
    assert back == b and back.settings == (123456, PEER)  # type: ignore[attr-defined]
    # an older agent's beat has no such field: it holds none
    h = {k: v for k, v in b.header().items() if k not in ("settings", "t")}
    assert Beat.parse(h).settings is None
    # the biggest beat (8 offers) still fits a sealed datagram
    assert len(encode(b)) <= MAX_BODY
    sealed = Signed(members["peer"]).seal(b, ("127.0.0.1", 7700))
    assert isinstance(decode(sealed)[0], Sealed) and len(sealed) < 1400


# -- gossip: what fails the check never replaces the document held ------------------------------


async def _serving(creds: Credentials, data: bytes) -> tuple[web.AppRunner, int]:
    app = web.Application()

    async def held(_: web.Request) -> web.Response:
        return web.Response(body=data, content_type="application/json")

    app.router.add_get("/v1/cluster/settings", held)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=Transport(creds).server_ssl).start()
    return runner, int(runner.addresses[0][1])


@pytest.mark.parametrize("case", ["model changed, signature kept", "unsigned, in a secured cluster", "too large"])
def test_a_bad_document_does_not_replace_the_one_held(
    members: dict[str, Any], tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    me, peer = members["me"], members["peer"]
    folder = tmp_path / "config"
    folder.mkdir()
    mine = _doc(me, version=1)
    cs.save(cs.path(folder), mine)
    held = cs.path(folder).read_bytes()
    data = _bad_docs(members)[case]

    async def go() -> SettingsGossip:
        g = SettingsGossip(Transport(me), me.cluster_id, ME, folder)
        assert g.load() == mine
        runner, port = await _serving(peer, data)
        try:
            g.on_beat(_beat(PEER, port, (9, PEER)), ("127.0.0.1", port))
            assert g._task is not None
            assert await asyncio.wait_for(g._task, 10) is False
            g.on_beat(_beat(PEER, port, (9, PEER)), ("127.0.0.1", port))  # backing off: no new fetch
            assert g._task.done()
        finally:
            await runner.cleanup()
        return g

    with caplog.at_level("WARNING", logger="agent.cluster.settings_gossip"):
        g = asyncio.run(go())
    assert g.held == mine and cs.path(folder).read_bytes() == held
    st = g.status()
    assert st["held"]["version"] == 1  # type: ignore[index]
    # a document too large is not even read whole: a failed fetch; the others are read and refused
    assert (st["fetch_failures"], st["refused"]) == ((1, 0) if case == "too large" else (0, 1)), st
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"the cluster settings v9 by node {PEER}" in warnings[0], warnings


def test_a_newer_document_is_fetched_adopted_and_survives_a_restart(members: dict[str, Any], tmp_path: Path) -> None:
    me, peer = members["me"], members["peer"]
    folder = tmp_path / "config"
    folder.mkdir()
    theirs = _doc(peer, version=3, weights="fp16")
    changes: list[ClusterSettings | None] = []

    async def go() -> SettingsGossip:
        g = SettingsGossip(Transport(me), me.cluster_id, ME, folder, on_change=changes.append)
        runner, port = await _serving(peer, json.dumps(theirs.to_json()).encode())
        try:
            g.on_beat(_beat(PEER, port, theirs.key), ("127.0.0.1", port))
            assert g._task is not None and await asyncio.wait_for(g._task, 10)
            g.on_beat(_beat(PEER, port, theirs.key), ("127.0.0.1", port))  # the one held: nothing to fetch
            assert g._task.done()
            # set here next: the version after the highest known, signed by this node
            mine = await g.async_set("smollm2-135m", None, "lookup", "alice")
            assert mine.key == (4, ME) and mine.signed and g.announce() == (4, ME)
        finally:
            await runner.cleanup()
        return g

    g = asyncio.run(go())
    assert [d.version if d else None for d in changes] == [3, 4]
    again = SettingsGossip(Transport(me), me.cluster_id, ME, folder)
    assert again.load() == g.held and again.held is not None and again.held.draft == "lookup"
    # the same file in another cluster's node is not used
    assert SettingsGossip(Transport(members["outsider"]), members["outsider"].cluster_id, ME, folder).load() is None


def test_a_document_whose_setter_is_revoked_is_dropped(members: dict[str, Any], tmp_path: Path) -> None:
    me, peer = members["me"], members["peer"]
    folder = tmp_path / "config"
    folder.mkdir()
    cs.save(cs.path(folder), _doc(peer, version=5))
    g = SettingsGossip(Transport(me), me.cluster_id, ME, folder)
    assert g.load() is not None and not g.check_setter()
    cluster.revoke(PEER, members["ca_dir"])
    assert me.adopt((members["ca_dir"] / files.REVOKED).read_bytes())
    assert g.check_setter() and g.held is None and g.announce() is None
    assert g.highest == 5  # the next setting here is v6: above what other members may still hold
    assert SettingsGossip(Transport(me), me.cluster_id, ME, folder).load() is None  # nor at the next start
