"""The credentials of a test control plane: a CA, the API server's serving certificate, the service-account
signing key and a static admin token (tests/certs.py makes the certificates)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.certs import make_ca

SERVICE_CIDR = "10.96.0.0/16"
"""Service cluster IPs (never dialled: nothing in the tests routes to them)."""
API_SERVICE_IP = "10.96.0.1"
"""The `kubernetes` Service's cluster IP, the first of SERVICE_CIDR: the serving certificate names it."""


@dataclass(frozen=True)
class Pki:
    """Files of the control plane's credentials (PEM) and the admin token."""

    ca_cert: str
    """CA of the serving certificate and of the controller manager's signer."""
    ca_key: str
    apiserver_cert: str
    apiserver_key: str
    sa_key: str
    """Private key that signs service-account tokens (controller manager and API server)."""
    sa_pub: str
    """Its public key, with which the API server checks them."""
    tokens_csv: str
    """Static token file: the admin token, user admin in group system:masters."""
    admin_token: str


def make_pki(directory: Path) -> Pki:
    """Write a fresh CA, serving certificate, service-account key pair and token file into `directory`."""
    ca = make_ca(directory, "ca")
    serving = ca.issue(directory, "apiserver", ips=["127.0.0.1", API_SERVICE_IP],
                       dns=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                            "kubernetes.default.svc.cluster.local"], client=False)
    sa = ec.generate_private_key(ec.SECP256R1())
    sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
    sa_key.write_bytes(sa.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
    sa_pub.write_bytes(sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    token = secrets.token_hex(24)
    tokens = directory / "tokens.csv"
    tokens.write_text(f'{token},admin,admin-uid,"system:masters"\n')
    tokens.chmod(0o600)
    return Pki(ca_cert=ca.cert_file, ca_key=str(directory / "ca.key"), apiserver_cert=serving.cert_file,
               apiserver_key=serving.key_file, sa_key=str(sa_key), sa_pub=str(sa_pub), tokens_csv=str(tokens),
               admin_token=token)


def kubeconfig_text(server: str, ca_file: str, token: str, namespace: str = "default") -> str:
    """A kubeconfig of one cluster, user and context (the current one)."""
    return (f"apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {ca_file}\n"
            f"users:\n- name: user\n  user:\n    token: {token}\n"
            f"contexts:\n- name: test\n  context:\n    cluster: test\n    user: user\n    namespace: {namespace}\n"
            f"current-context: test\n")
