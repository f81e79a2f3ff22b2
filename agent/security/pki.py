"""Keys and certificates (pure functions over the ``cryptography`` package).

* Every key is ECDSA on P-256; signatures are ECDSA with SHA-256 (DER encoded).
* The CA certificate is self-signed, valid 10 years, ``CN=lakeshard cluster CA``.
* The **cluster id** is the first 16 bytes (128 bits) of the SHA-256 of the CA certificate's DER,
  in lower-case base32 without padding: 26 letters and digits, e.g.
  ``k3v7q2m9...``. It names the CA exactly (a second CA with the same id would need a 128-bit
  second preimage), fits the settings' ``cluster_id`` pattern, and can be read out over a phone.
* A node certificate: ``CN=<node id>`` (12 hex digits, :func:`agent.cluster.node_state.node_id`),
  ``O=<cluster id>``, a random serial, valid one year (never past the CA), for both TLS server
  and client use. The node makes its key and a CSR; only the CSR travels.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import re

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.security.errors import SecurityError

NODE_ID_RE = re.compile(r"^[0-9a-f]{12}$")
CLUSTER_ID_RE = re.compile(r"^[a-z2-7]{26}$")
CA_CN = "lakeshard cluster CA"
CA_DAYS = 3652  # 10 years
NODE_DAYS = 365
SKEW = dt.timedelta(minutes=5)  # certificates start a little in the past: clocks differ
MAX_PEM = 8 * 1024  # a CSR or certificate of ours is well under 1 KB

PrivateKey = ec.EllipticCurvePrivateKey


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> PrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_key(pem: bytes) -> PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise SecurityError(f"not a usable private key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise SecurityError("the private key is not an ECDSA P-256 key")
    return key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def cert_der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def load_cert(data: bytes) -> x509.Certificate:
    """A certificate from PEM or DER bytes (at most 8 KB)."""
    if len(data) > MAX_PEM:
        raise SecurityError("the certificate is too large")
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError as e:
        raise SecurityError(f"not a certificate: {e}") from None


def fingerprint(cert: x509.Certificate) -> bytes:
    """SHA-256 of the certificate's DER."""
    return hashlib.sha256(cert_der(cert)).digest()


def cluster_id_of(ca_cert: x509.Certificate) -> str:
    """The cluster id a CA certificate defines (see the module's docstring)."""
    return cluster_id_from_bytes(fingerprint(ca_cert)[:16])


def cluster_id_from_bytes(raw: bytes) -> str:
    return base64.b32encode(raw).decode().lower().rstrip("=")


def cluster_id_bytes(cluster_id: str) -> bytes:
    if not CLUSTER_ID_RE.match(cluster_id):
        raise SecurityError(f"{cluster_id!r} is not a cluster id (26 base32 letters and digits)")
    return base64.b32decode(cluster_id.upper() + "======")


def _name(**attrs: str) -> x509.Name:
    oids = {"cn": NameOID.COMMON_NAME, "o": NameOID.ORGANIZATION_NAME}
    return x509.Name([x509.NameAttribute(oids[k], v) for k, v in attrs.items()])


def make_ca(key: PrivateKey | None = None, now: dt.datetime | None = None) -> tuple[PrivateKey, x509.Certificate]:
    """A new cluster CA: its key and its self-signed certificate."""
    key = key or new_key()
    t = now or _now()
    pub = key.public_key()
    name = _name(cn=CA_CN)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(pub)
        .serial_number(x509.random_serial_number())
        .not_valid_before(t - SKEW)
        .not_valid_after(t + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_csr(key: PrivateKey, node: str) -> x509.CertificateSigningRequest:
    if not NODE_ID_RE.match(node):
        raise SecurityError(f"{node!r} is not a node id (12 hex digits)")
    return x509.CertificateSigningRequestBuilder().subject_name(_name(cn=node)).sign(key, hashes.SHA256())


def csr_pem(csr: x509.CertificateSigningRequest) -> bytes:
    return csr.public_bytes(serialization.Encoding.PEM)


def csr_der(csr: x509.CertificateSigningRequest) -> bytes:
    return csr.public_bytes(serialization.Encoding.DER)


def load_csr(pem: bytes) -> x509.CertificateSigningRequest:
    if len(pem) > MAX_PEM:
        raise SecurityError("the certificate request is too large")
    try:
        return x509.load_pem_x509_csr(pem)
    except ValueError as e:
        raise SecurityError(f"not a certificate request: {e}") from None


def _cn(name: x509.Name) -> str:
    attrs = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    v = attrs[0].value if len(attrs) == 1 else None
    return v if isinstance(v, str) else ""


def check_csr(csr: x509.CertificateSigningRequest) -> str:
    """The node id a CSR asks for, once its signature, key type and name are right."""
    if not csr.is_signature_valid:
        raise SecurityError("the certificate request's signature is not valid")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise SecurityError("the certificate request's key is not an ECDSA P-256 key")
    node = _cn(csr.subject)
    if not NODE_ID_RE.match(node):
        raise SecurityError(f"the certificate request names {node!r}, not a node id (12 hex digits)")
    return node


def issue(
    ca_key: PrivateKey, ca_cert: x509.Certificate, csr: x509.CertificateSigningRequest, now: dt.datetime | None = None
) -> x509.Certificate:
    """Sign a node certificate for a checked CSR (:func:`check_csr`)."""
    node = check_csr(csr)
    t = now or _now()
    pub = csr.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    ca_pub = ca_key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(_name(cn=node, o=cluster_id_of(ca_cert)))
        .issuer_name(ca_cert.subject)
        .public_key(pub)
        .serial_number(x509.random_serial_number())
        .not_valid_before(t - SKEW)
        .not_valid_after(min(t + dt.timedelta(days=NODE_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_pub), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def node_of(cert: x509.Certificate) -> str:
    """The certificate's CN (a node id for a node certificate)."""
    return _cn(cert.subject)


def cluster_of(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    v = attrs[0].value if len(attrs) == 1 else None
    return v if isinstance(v, str) else ""


def check_node_cert(cert: x509.Certificate, ca_cert: x509.Certificate, now: dt.datetime | None = None) -> str:
    """The node id of ``cert`` once it is a node certificate of ``ca_cert``'s cluster: signed by
    that CA, valid now, not a CA, named by a node id, with the CA's cluster id in O."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise SecurityError("the certificate is not signed by this cluster's CA") from None
    t = now or _now()
    if not cert.not_valid_before_utc <= t <= cert.not_valid_after_utc:
        raise SecurityError(f"the certificate is not valid now (valid until {cert.not_valid_after_utc:%Y-%m-%d})")
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        raise SecurityError("the certificate has no basic constraints") from None
    if bc.ca:
        raise SecurityError("a CA certificate is not a node's")
    node = node_of(cert)
    if not NODE_ID_RE.match(node):
        raise SecurityError(f"the certificate names {node!r}, not a node id")
    if cluster_of(cert) != cluster_id_of(ca_cert):
        raise SecurityError("the certificate names another cluster")
    return node


def sign(key: PrivateKey, data: bytes) -> bytes:
    """An ECDSA (SHA-256) signature of ``data``, DER encoded."""
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


def signature_ok(cert_or_key: x509.Certificate | ec.EllipticCurvePublicKey, data: bytes, sig: bytes) -> bool:
    pub = cert_or_key.public_key() if isinstance(cert_or_key, x509.Certificate) else cert_or_key
    if not isinstance(pub, ec.EllipticCurvePublicKey):
        return False
    try:
        pub.verify(sig, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True
