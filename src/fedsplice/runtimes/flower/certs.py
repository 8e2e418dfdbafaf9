"""TLS certificates and SuperNode authentication keys, generated with `cryptography`.

`make_tls` writes a throw-away certificate authority and a SuperLink server certificate signed
by it (SANs: the given host names / IPs, loopback by default) — what Flower's
`--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile` (SuperLink) and `--root-certificates`
(SuperNode, `flwr` CLI) expect. `make_node_key` writes one SuperNode's EC key pair in OpenSSH
format: the private key stays with the SuperNode (`--auth-supernode-private-key`), the public
key is registered at the SuperLink (`flwr supernode register`) so only known nodes may connect.

Private keys are written with mode 0600. Nothing here is meant for a long-lived production PKI:
for that, use your organisation's CA and keep the CA key offline.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TLSFiles:
    ca_cert: Path  # --ssl-ca-certfile (SuperLink), --root-certificates (SuperNode, flwr CLI)
    server_cert: Path  # --ssl-certfile
    server_key: Path  # --ssl-keyfile


@dataclass(frozen=True)
class NodeKey:
    private: Path  # --auth-supernode-private-key
    public: Path  # `flwr supernode register <public>`


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedsplice"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for h in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            entries.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(entries)


def make_tls(folder: Path, hosts: list[str] | None = None, days: int = 30) -> TLSFiles:
    """A CA and a server certificate for `hosts` (default: 127.0.0.1, ::1, localhost)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hosts = hosts or ["127.0.0.1", "::1", "localhost"]
    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = _name("fedsplice test CA")
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))

    files = TLSFiles(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.server_key, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    # The CA key is not needed after signing; it is not written to disk.
    return files


def make_node_key(folder: Path, name: str) -> NodeKey:
    """An EC (P-384) key pair in OpenSSH format, as Flower's SuperNode authentication takes."""
    folder = Path(folder)
    key = ec.generate_private_key(ec.SECP384R1())
    nk = NodeKey(folder / name, folder / f"{name}.pub")
    _write_private(nk.private, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    nk.public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b" fedsplice-" + name.encode() + b"\n")
    return nk
