"""Certificates made at test time (the `cryptography` package): a CA, a server certificate for
localhost/127.0.0.1, client certificates from that CA and from a stranger's CA."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(cn: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, server: bool) -> tuple[bytes, bytes]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
    )
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _pem_cert(b.sign(ca_key, hashes.SHA256())), _pem_key(key)


@dataclass(frozen=True)
class Certs:
    """Paths of PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    """A client certificate from a CA the servers do not trust."""
    stranger_key: Path


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca("meshrl test CA")
    other, other_key = _ca("someone else's CA")
    files = {
        "ca": _pem_cert(ca),
        **dict(zip(("server_cert", "server_key"), _leaf("localhost", ca, ca_key, server=True), strict=True)),
        **dict(zip(("client_cert", "client_key"), _leaf("rollout-0", ca, ca_key, server=False), strict=True)),
        **dict(zip(("stranger_cert", "stranger_key"), _leaf("mallory", other, other_key, server=False), strict=True)),
    }
    paths = {}
    for name, data in files.items():
        p = directory / f"{name}.pem"
        p.write_bytes(data)
        paths[name] = p
    return Certs(**paths)
