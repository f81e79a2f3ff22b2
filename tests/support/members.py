"""Cluster members for tests: credentials made through the CA holder's own answer, homes, TLS exchanges."""

from __future__ import annotations

import json
import os
import secrets
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.cluster.node_state import node_id
from agent.common import paths
from agent.security import cluster, files, join, pki, tokens
from agent.security.credentials import Credentials


def make_member(ca_dir: Path, folder: Path, node: str) -> Credentials:
    """``node`` joins the CA in ``ca_dir`` through the CA holder's own answer (no network here)."""
    ca = Credentials.load(ca_dir)
    tok = tokens.parse_token(cluster.invite("127.0.0.1:7700", 60, 1, ca_dir))
    key, body = join_request(tok, node)
    ans = join.answer_join(ca, body)
    files.write_private(folder / files.NODE_KEY, pki.key_pem(key))
    files.write_public(folder / files.CA_CERT, ans["ca"].encode())
    files.write_json(folder / files.REVOKED, ans["revoked"])
    files.write_public(folder / files.NODE_CERT, ans["cert"].encode())
    return Credentials.load(folder)


@dataclass
class Home:
    path: Path
    port: int = 0

    @property
    def env(self) -> dict[str, str]:
        shared = os.environ.get("LAKESHARD_SHARED_CACHE") or str(paths.cache_dir())  # models and exports
        return {"LAKESHARD_HOME": str(self.path), "LAKESHARD_SHARED_CACHE": shared}

    @property
    def security(self) -> Path:
        return self.path / "config" / "security"

    def node(self) -> str:
        """The node id the agent on ``port`` will have (made here, read back by the agent)."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LAKESHARD_HOME", str(self.path))
            return node_id(paths.agent_state_dir(self.port))


def exchange(port: int, ctx: ssl.SSLContext | None, path: str = "/v1/node") -> bytes | BaseException:
    """A GET on the data port (TLS with ``ctx``, else plain): the raw answer, or what it raised."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            sock = ctx.wrap_socket(raw) if ctx is not None else raw
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n".encode())
            out = b""
            while chunk := sock.recv(65536):
                out += chunk
            return out
    except (OSError, ssl.SSLError) as e:
        return e


def join_request(
    tok: tokens.JoinToken, node: str, key: Any = None, *, secret: bytes | None = None
) -> tuple[Any, bytes]:
    """A join request body for ``node`` (its key and the body), as the joiner makes it."""
    key = key or pki.new_key()
    csr = pki.make_csr(key, node)
    nonce = secrets.token_bytes(16)
    k = tokens.join_key(secret) if secret is not None else tok.key
    proof = tokens.proof(k, tok.token_id, pki.csr_der(csr), nonce)
    body = {"token": tok.token_id, "csr": pki.csr_pem(csr).decode(), "nonce": nonce.hex(), "proof": proof.hex()}
    return key, json.dumps(body).encode()
