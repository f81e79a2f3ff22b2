"""Cluster identity: a cluster CA, node certificates, join tokens and a signed revocation list.

Everything lives in ``config_dir()/security/`` (see :mod:`agent.security.files`):

* ``ca.crt``: the cluster's CA certificate; the cluster id is its fingerprint
  (:func:`agent.security.pki.cluster_id_of`);
* ``ca.key``: the CA's private key, only on the node(s) that hold the CA (0600);
* ``node.key`` / ``node.crt``: this node's key pair (made here, never sent) and its certificate
  (CN = node id, O = cluster id), signed by the CA;
* ``revoked.json``: the revocation list, signed by the CA key (any member can check it);
* ``invites.json``: on a CA holder, the outstanding join tokens (a key derived from each secret,
  never the secret itself);
* ``member.json``: how this node joined (which node signed its certificate, and when).

What other parts use: :mod:`agent.security.transport` (how node links travel: mutual TLS or,
only with ``--insecure``, plaintext; a node without credentials waits for a cluster instead),
:class:`agent.security.credentials.Credentials` (TLS contexts, peer identity, signatures),
:mod:`agent.security.datagrams` (election datagrams signed with the node key and checked against
the CA, or plaintext), :mod:`agent.cluster.fencing` (an elected agent takes assignments only from
the coordinator its election admitted for their term) and the operations in
:mod:`agent.security.cluster` (what the CLI calls, and the local API's cluster routes in
:mod:`agent.security.local_routes`, which the tray calls).
"""

from agent.security.errors import JoinError, SecurityError

__all__ = ["JoinError", "SecurityError"]
