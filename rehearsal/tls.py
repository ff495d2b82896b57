"""The rehearsal's own certificate authority, standing in for cert-manager's ClusterIssuer (infra/bootstrap.py) and
the Gateway's Certificate (infra/serving_platform.py: `*.<domain>` and `*.grpc.<domain>`, ECDSA P-256).

`CertificateAuthority.create(dir)` makes a CA (key and self-signed certificate, written as `ca.pem`); `issue(names,
dir)` signs a server certificate for the model hostnames and writes the one PEM file HAProxy's `crt` reads
(certificate, then the CA's, then the key). Clients trust the CA and nothing else: `httpx_verify()` for httpx's
`verify=`, `grpc_credentials()` for a grpcio secure channel.

It uses the `cryptography` package (in `.venv-serving` through moto and vLLM's dependencies); nothing is written
outside the given directories and the CA's key never leaves memory.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=2)  # a rehearsal lasts minutes; a short life keeps a leaked file worthless
_PEM = serialization.Encoding.PEM


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llm-serving rehearsal"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(_PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


@dataclass(frozen=True)
class ServerCertificate:
    names: tuple[str, ...]
    pem_path: Path  # certificate chain and key, for HAProxy's `bind ... ssl crt <pem_path>`
    cert_pem: bytes


@dataclass(frozen=True)
class CertificateAuthority:
    cert_pem: bytes
    ca_path: Path  # the CA certificate clients trust
    _key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, directory: Path, name: str = "llm-serving rehearsal CA") -> CertificateAuthority:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(_name(name)).issuer_name(_name(name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        pem = cert.public_bytes(_PEM)
        path = directory / "ca.pem"
        path.write_bytes(pem)
        return cls(pem, path, key)

    def issue(self, names: list[str] | tuple[str, ...], directory: Path, stem: str = "gateway") -> ServerCertificate:
        """A server certificate for `names` (DNS names, wildcards such as `*.example.com`, or IP addresses)."""
        if not names:
            raise ValueError("a server certificate needs at least one name")
        names = tuple(dict.fromkeys(names))
        ca = x509.load_pem_x509_certificate(self.cert_pem)
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(_name(names[0])).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        cert_pem = cert.public_bytes(_PEM)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{stem}.pem"
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_bytes(cert_pem + self.cert_pem + _key_pem(key))
        return ServerCertificate(names, path, cert_pem)

    def httpx_verify(self) -> ssl.SSLContext:
        """httpx's `verify=`: this CA only (not the system's), hostnames checked."""
        return ssl.create_default_context(cafile=str(self.ca_path))

    def grpc_credentials(self):
        """Channel credentials for `grpc.secure_channel` that trust this CA only."""
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.cert_pem)
