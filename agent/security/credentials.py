"""A member's credentials, loaded from the security folder: what node links and beats use.

* :meth:`Credentials.server_ssl_context` / :meth:`Credentials.client_ssl_context`: TLS 1.3 only,
  a certificate required on both sides, only this cluster's CA trusted. Peers are reached by IP
  address, so there is no host name check: a peer's identity is the node id in its certificate.
* :meth:`Credentials.peer_node_id`: after a handshake, the peer's node id from its certificate;
  it also refuses a revoked node, a certificate of another CA and one that is not valid now.
  The TLS layer itself checks only the CA: **a link must call this before it trusts a peer**.
* :meth:`Credentials.sign` / :meth:`Credentials.verify`: ECDSA signatures of this node, and a
  check of another member's (its certificate's DER travels with the data).
* :meth:`Credentials.adopt`: take a newer, validly signed revocation list handed over by anyone.
"""

from __future__ import annotations

import datetime as dt
import ssl
import threading
from pathlib import Path
from typing import Any

from cryptography import x509

from agent.security import files, pki, revocation
from agent.security.errors import SecurityError
from agent.security.revocation import RevocationList

Peer = ssl.SSLObject | ssl.SSLSocket | bytes | bytearray | memoryview


class NotMember(SecurityError):
    """This node holds no credentials (it has not run ``cluster init`` or ``cluster join``)."""


class Credentials:
    def __init__(
        self,
        folder: Path,
        ca_cert: x509.Certificate,
        node_cert: x509.Certificate,
        node_key: pki.PrivateKey,
        revoked: RevocationList | None = None,
        ca_key: pki.PrivateKey | None = None,
    ) -> None:
        self.folder = folder
        self.ca_cert = ca_cert
        self.cluster_id = pki.cluster_id_of(ca_cert)
        self.node_id = pki.check_node_cert(node_cert, ca_cert)
        if node_cert.public_key() != node_key.public_key():
            raise SecurityError("node.key does not belong to node.crt")
        self.node_cert = node_cert
        self.node_key = node_key
        self.ca_key = ca_key
        self.revoked = revoked.check(ca_cert) if revoked is not None else None
        self._lock = threading.Lock()

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, folder: Path | None = None) -> Credentials:
        """The credentials in ``folder`` (default: the security folder). :class:`NotMember` if
        this node has none; :class:`SecurityError` if they are damaged or do not fit together."""
        d = files.security_path(folder)
        if not (d / files.NODE_CERT).is_file() or not (d / files.CA_CERT).is_file():
            raise NotMember("this node is not in a secured cluster: run 'lakeshard cluster init' or 'cluster join'")
        try:
            ca = pki.load_cert((d / files.CA_CERT).read_bytes())
            cert = pki.load_cert((d / files.NODE_CERT).read_bytes())
            key = pki.load_key((d / files.NODE_KEY).read_bytes())
            ca_key = pki.load_key((d / files.CA_KEY).read_bytes()) if (d / files.CA_KEY).is_file() else None
            rl = load_revocations(d, ca)
        except OSError as e:
            raise SecurityError(f"cannot read the credentials in {d}: {e}") from None
        if ca_key is not None and ca_key.public_key() != ca.public_key():
            raise SecurityError(f"{d / files.CA_KEY} does not belong to {d / files.CA_CERT}")
        try:
            return cls(d, ca, cert, key, rl, ca_key)
        except SecurityError as e:
            raise SecurityError(f"{d / files.NODE_CERT}: {e}") from None

    @property
    def holds_ca(self) -> bool:
        """Whether this node can sign certificates (it has ``ca.key``)."""
        return self.ca_key is not None

    @property
    def node_cert_der(self) -> bytes:
        return pki.cert_der(self.node_cert)

    @property
    def expires(self) -> dt.datetime:
        return self.node_cert.not_valid_after_utc

    # -- TLS -------------------------------------------------------------------------------------
    def server_ssl_context(self) -> ssl.SSLContext:
        return self._context(server=True)

    def client_ssl_context(self) -> ssl.SSLContext:
        return self._context(server=False)

    def _context(self, *, server: bool) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # peers are reached by IP; identity is the certificate's CN
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
        ctx.load_verify_locations(cadata=pki.cert_pem(self.ca_cert).decode())
        ctx.load_cert_chain(self.folder / files.NODE_CERT, self.folder / files.NODE_KEY)
        return ctx

    def peer_node_id(self, peer: Peer) -> str:
        """The node id of the peer at the other end of a TLS connection (its ``ssl_object``, e.g.
        ``transport.get_extra_info("ssl_object")``), or of a certificate's DER bytes. Raises
        :class:`SecurityError` for a certificate of another CA, one not valid now, or a revoked node."""
        der = bytes(peer) if isinstance(peer, bytes | bytearray | memoryview) else peer.getpeercert(binary_form=True)
        if not der:
            raise SecurityError("the peer showed no certificate")
        node = pki.check_node_cert(pki.load_cert(der), self.ca_cert)
        if self.is_revoked(node):
            raise SecurityError(f"node {node} is revoked")
        return node

    # -- signatures ------------------------------------------------------------------------------
    def sign(self, data: bytes) -> bytes:
        """This node's signature of ``data`` (ECDSA P-256, SHA-256, DER)."""
        return pki.sign(self.node_key, data)

    def verify(self, cert_der: bytes, data: bytes, sig: bytes) -> str:
        """The node id of the member whose certificate is ``cert_der``, once ``sig`` is its valid
        signature of ``data`` (and the certificate is this cluster's, valid, not revoked)."""
        node = self.peer_node_id(cert_der)
        if not pki.signature_ok(pki.load_cert(cert_der), data, sig):
            raise SecurityError(f"the signature is not node {node}'s")
        return node

    # -- revocation ------------------------------------------------------------------------------
    def is_revoked(self, node: str) -> bool:
        rl = self.revoked
        return rl is not None and node in rl.nodes

    @property
    def revocation_version(self) -> int:
        return -1 if self.revoked is None else self.revoked.version

    def adopt(self, offered: RevocationList | dict[str, Any] | bytes) -> bool:
        """Take ``offered`` (a list, its JSON object or its bytes) if it is validly signed by this
        cluster's CA and newer than the one held; it is written to ``revoked.json``. Returns
        whether it was taken; a list that fails the check raises :class:`SecurityError`."""
        if isinstance(offered, bytes):
            rl = revocation.parse(offered, self.ca_cert)
        else:
            rl = offered if isinstance(offered, RevocationList) else revocation.from_json(offered)
        with self._lock, files.locked(self.folder):
            on_disk = load_revocations(self.folder, self.ca_cert)
            if on_disk is not None and (self.revoked is None or on_disk.version > self.revoked.version):
                self.revoked = on_disk
            if not revocation.newer(self.revoked, rl, self.ca_cert):
                return False
            files.write_json(self.folder / files.REVOKED, rl.to_json())
            self.revoked = rl
        return True

    def refresh(self) -> bool:
        """Re-read ``revoked.json`` (another process may have written a newer list)."""
        rl = load_revocations(self.folder, self.ca_cert)
        if rl is not None and rl.version > self.revocation_version:
            self.revoked = rl
            return True
        return False


def load_revocations(folder: Path, ca_cert: x509.Certificate) -> RevocationList | None:
    """``revoked.json`` of ``folder``, checked; None when there is none."""
    try:
        d = files.read_json(folder / files.REVOKED)
    except ValueError as e:
        raise SecurityError(f"{folder / files.REVOKED} is damaged: {e}") from None
    if d is None:
        return None
    try:
        return revocation.from_json(d).check(ca_cert)
    except SecurityError as e:
        raise SecurityError(f"{folder / files.REVOKED}: {e}") from None
