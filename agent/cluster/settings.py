"""The cluster settings document: which model the cluster serves, versioned, signed, gossiped.

``cluster_settings.json`` in the config folder (the same on every member, whoever set it)::

    {"cluster": "<cluster id>", "version": 3, "model": "smollm2-135m", "weights": "int8",
     "draft": null, "set_by": "3f2a9c1d0b7e", "set_by_name": "alice-laptop", "set_at": 1767225600,
     "cert": "<base64 DER of the setter's node certificate>", "signature": "<base64>"}

Any member sets it through its own local API (the laptop's user, or its tray). In a cluster
with credentials the setter signs the canonical body (:meth:`ClusterSettings.body`: every field
but ``cert`` and ``signature``, JSON with sorted keys, after a domain prefix of its own, so the
node key's signature is never mistaken for a beat's) and includes its certificate: any member
can check it (:func:`check`: this cluster, a certificate of the cluster CA, valid and not
revoked, naming ``set_by``), so the document may travel by gossip. In a plaintext cluster
(``--insecure``) it travels unsigned, and is taken as it comes.

Documents are ordered by ``(version, set_by)`` (:attr:`ClusterSettings.key`): the higher wins,
so two laptops that set it at the same moment (both taking the next version) end on one value
everywhere. Model and draft names are store or registry names (never paths: a member must not
make the coordinator read a file of its choosing).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.common.config import CLUSTER_RE, WEIGHTS
from agent.common.paths import config_dir, write_json_atomic
from agent.security.credentials import Credentials
from agent.security.errors import SecurityError

FILE = "cluster_settings.json"
DOMAIN = b"lakeshard/cluster-settings/1\0"
MAX_BYTES = 16 * 1024  # on the wire and on disk (a signed document is about 1.2 KB)
MAX_VERSION = 1 << 31
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SET_BY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a node id (12 hex digits, from identity)
LOOKUP = "lookup"


class SettingsError(SecurityError):
    """A cluster settings document that is not taken; the message says why."""


@dataclass(frozen=True)
class ClusterSettings:
    cluster: str
    version: int
    model: str
    weights: str | None  # None: the model's default
    draft: str | None  # speculative decoding: a draft model name, "lookup" or "NAME+lookup"
    set_by: str  # the node id of the member that set it
    set_at: int  # Unix seconds, by the setter's clock (shown, never compared)
    set_by_name: str | None = None  # what node maps call that member
    cert: bytes | None = None  # the setter's node certificate (DER), in a secured cluster
    signature: bytes | None = None

    @property
    def key(self) -> tuple[int, str]:
        """What orders documents: the higher wins."""
        return self.version, self.set_by

    @property
    def signed(self) -> bool:
        return self.cert is not None and self.signature is not None

    def fields(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "version": self.version,
            "model": self.model,
            "weights": self.weights,
            "draft": self.draft,
            "set_by": self.set_by,
            "set_by_name": self.set_by_name,
            "set_at": self.set_at,
        }

    def body(self) -> bytes:
        """What the signature covers."""
        return DOMAIN + json.dumps(self.fields(), sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> dict[str, Any]:
        d = self.fields()
        d["cert"] = base64.b64encode(self.cert).decode() if self.cert is not None else None
        d["signature"] = base64.b64encode(self.signature).decode() if self.signature is not None else None
        return d

    def label(self) -> str:
        """``cluster setting v3 by alice-laptop``."""
        return f"cluster setting v{self.version} by {self.set_by_name or self.set_by}"


def newer(current: ClusterSettings | None, offered: ClusterSettings) -> bool:
    return current is None or offered.key > current.key


# -- shape ---------------------------------------------------------------------------------------


def check_model(v: Any, what: str = "model") -> str:
    if not isinstance(v, str) or not MODEL_RE.match(v):
        raise SettingsError(f"{what} must be a model name (letters, digits, '.', '_' or '-'), got {v!r}")
    return v


def check_weights(v: Any) -> str | None:
    if v is None:
        return None
    if v not in WEIGHTS:
        raise SettingsError(f"weights must be one of {', '.join(WEIGHTS)}, got {v!r}")
    return str(v)


def check_draft(v: Any) -> str | None:
    if v is None:
        return None
    if v == LOOKUP:
        return LOOKUP
    if isinstance(v, str) and v.endswith("+" + LOOKUP):
        check_model(v.removesuffix("+" + LOOKUP), "draft")
        return v
    return check_model(v, "draft")


def draft_model(draft: str | None) -> str | None:
    """The model a draft setting names (None for none, or prompt lookup alone)."""
    if draft is None or draft == LOOKUP:
        return None
    return draft.removesuffix("+" + LOOKUP)


def _b64(v: Any, what: str, most: int) -> bytes | None:
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > most:
        raise SettingsError(f"the cluster settings' {what} is not base64")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise SettingsError(f"the cluster settings' {what} is not base64") from None


def from_json(d: Any) -> ClusterSettings:
    """A document from its JSON form (its shape only: :func:`check` checks whose it is)."""
    if not isinstance(d, dict):
        raise SettingsError("the cluster settings are not a JSON object")
    cluster, version, set_at = d.get("cluster"), d.get("version"), d.get("set_at")
    if not isinstance(cluster, str) or not CLUSTER_RE.match(cluster):
        raise SettingsError("the cluster settings name no cluster")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
        raise SettingsError("the cluster settings have no version number")
    if isinstance(set_at, bool) or not isinstance(set_at, int) or set_at < 0:
        raise SettingsError("the cluster settings say not when they were set")
    set_by, name = d.get("set_by"), d.get("set_by_name")
    if not isinstance(set_by, str) or not SET_BY_RE.match(set_by):
        raise SettingsError("the cluster settings name no node that set them")
    if name is not None and (not isinstance(name, str) or not 0 < len(name) <= 64 or not name.isprintable()):
        raise SettingsError("the cluster settings' set_by_name is not a name")
    return ClusterSettings(
        cluster=cluster,
        version=version,
        model=check_model(d.get("model")),
        weights=check_weights(d.get("weights")),
        draft=check_draft(d.get("draft")),
        set_by=set_by,
        set_at=set_at,
        set_by_name=name,
        cert=_b64(d.get("cert"), "certificate", 8192),
        signature=_b64(d.get("signature"), "signature", 256),
    )


def parse(data: bytes) -> ClusterSettings:
    """A document from bytes handed over by anyone (its shape only)."""
    if len(data) > MAX_BYTES:
        raise SettingsError(f"the cluster settings are {len(data)} bytes (at most {MAX_BYTES})")
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise SettingsError("the cluster settings are not JSON") from None
    return from_json(d)


# -- whose it is ---------------------------------------------------------------------------------


def check(doc: ClusterSettings, cluster: str, creds: Credentials | None) -> ClusterSettings:
    """``doc``, once it is this cluster's and (``creds``: a secured cluster) signed by the member
    it names, with a certificate of this cluster's CA that is valid now and not revoked."""
    if doc.cluster != cluster:
        raise SettingsError(f"the cluster settings are cluster {doc.cluster}'s, not this one's ({cluster})")
    if creds is None:
        return doc  # a plaintext cluster: nothing to check them against
    if doc.cert is None or doc.signature is None:
        raise SettingsError("the cluster settings are not signed, and this cluster is a secured one")
    try:
        node = creds.verify(doc.cert, doc.body(), doc.signature)
    except SecurityError as e:
        raise SettingsError(f"the cluster settings' signature is refused: {e}") from None
    if node != doc.set_by:
        raise SettingsError(f"the cluster settings name node {doc.set_by} as their setter, but node {node} signed them")
    return doc


def make(
    cluster: str,
    version: int,
    model: str,
    weights: str | None,
    draft: str | None,
    set_by: str,
    set_by_name: str | None = None,
    creds: Credentials | None = None,
    at: int | None = None,
) -> ClusterSettings:
    """A new document (signed by ``creds``, whose node id it names as the setter, when given)."""
    if creds is not None:
        set_by = creds.node_id
    doc = ClusterSettings(
        cluster=cluster,
        version=version,
        model=check_model(model),
        weights=check_weights(weights),
        draft=check_draft(draft),
        set_by=set_by,
        set_at=int(time.time()) if at is None else at,
        set_by_name=(set_by_name or "")[:64].strip() or None,
    )
    if creds is None:
        return doc
    return replace(doc, cert=creds.node_cert_der, signature=creds.sign(doc.body()))


# -- on disk -------------------------------------------------------------------------------------


def path(folder: Path | None = None) -> Path:
    return (folder or config_dir()) / FILE


def load(file: Path) -> ClusterSettings | None:
    """The document in ``file`` (its shape only); None when there is none."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SettingsError(f"cannot read {file}: {e}") from None
    try:
        return parse(data)
    except SettingsError as e:
        raise SettingsError(f"{file}: {e}") from None


def save(file: Path, doc: ClusterSettings) -> None:
    """Write ``doc`` so a reader (or a crash) sees the old document or the new one."""
    write_json_atomic(file, doc.to_json(), indent=2)
