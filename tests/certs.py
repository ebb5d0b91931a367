"""Certificates made inside a test (the `cryptography` package): a CA, and leaf certificates it signs.

    ca = make_ca(tmp_path, "test-ca")
    server = ca.issue(tmp_path, "server", dns=["localhost"], ips=["127.0.0.1"])
    server.cert_file, server.key_file, ca.cert_file     # PEM files
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=2)


@dataclass
class Issued:
    """A certificate and its private key, as PEM files."""

    name: str
    cert_file: str
    key_file: str


@dataclass
class CertificateAuthority:
    name: str
    cert_file: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def issue(self, directory: Path, name: str, dns: list[str] | None = None, ips: list[str] | None = None,
              server: bool = True, client: bool = True) -> Issued:
        """A leaf certificate for `name` with the given subject alternative names, signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + \
                 ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns or []]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips or []]
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Issued(name, *_write(directory, f"{self.name}-{name}", cert, key))


def make_ca(directory: Path, name: str) -> CertificateAuthority:
    """A self-signed CA whose certificate is written to `directory`/`name`.crt."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, _ = _write(directory, name, cert, key)
    return CertificateAuthority(name, cert_file, key, cert)


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)
