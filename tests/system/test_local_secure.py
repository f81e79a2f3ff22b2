"""``make run``'s cluster is a secure one: LocalCluster(form=True) makes a throwaway cluster
through the agents' local APIs, as the tray does (init on the first, invite, join the others)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from coordinator.lab.local_cluster import LocalCluster


def _identity(api_port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{api_port}/v1/cluster/identity", timeout=10) as r:
        return dict(json.loads(r.read()))


def test_a_local_cluster_forms_a_throwaway_cluster_and_speaks_only_tls() -> None:
    with LocalCluster(2, elect=[], secure=True, form=True) as c:
        ids = [_identity(p) for p in c.api_ports]
        assert c.cluster_id and len(c.cluster_id) == 26
        assert [i["cluster_id"] for i in ids] == [c.cluster_id, c.cluster_id]
        assert [i["holds_ca"] for i in ids] == [True, False]
        assert ids[1]["signed_by"] == ids[0]["node_id"]
        for port in c.ports:  # a plain HTTP client gets nothing from a member's data port
            with pytest.raises(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/node", timeout=5)


def test_forming_needs_secure_elected_agents() -> None:
    with pytest.raises(ValueError, match="secure, elected"):
        LocalCluster(2, elect=[], form=True)
    with pytest.raises(ValueError, match="secure, elected"):
        LocalCluster(2, secure=True, form=True)
