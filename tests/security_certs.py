"""Certificates made for a test with `cryptography`: a CA and certificates it signs for loopback.

`make_pki(directory)` writes ca.pem, a "service" certificate for localhost/127.0.0.1 (usable as
server and as client certificate, as every pdserve process uses its own for both) and a "rogue"
one of another CA (what an outsider holding some certificate would present).
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


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    rogue_cert: Path
    rogue_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def _ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(common_name, _name(common_name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert: x509.Certificate, common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    eku = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    cert = (_builder(common_name, ca_cert.subject, key.public_key())
            .add_extension(san, critical=False).add_extension(eku, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _write(path: Path, *items) -> Path:
    pem = b""
    for item in items:
        if isinstance(item, x509.Certificate):
            pem += item.public_bytes(serialization.Encoding.PEM)
        else:
            pem += item.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())
    path.write_bytes(pem)
    return path


def make_pki(directory: Path) -> Pki:
    ca_key, ca_cert = _ca("pdserve test CA")
    key, cert = _leaf(ca_key, ca_cert, "pdserve service")
    rogue_ca_key, rogue_ca_cert = _ca("some other CA")
    rogue_key, rogue_cert = _leaf(rogue_ca_key, rogue_ca_cert, "rogue")
    return Pki(ca=_write(directory / "ca.pem", ca_cert), cert=_write(directory / "service.pem", cert),
               key=_write(directory / "service.key", key), rogue_cert=_write(directory / "rogue.pem", rogue_cert),
               rogue_key=_write(directory / "rogue.key", rogue_key))
