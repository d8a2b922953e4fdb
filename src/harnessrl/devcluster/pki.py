"""The test cluster's private PKI, made the way envtest makes it.

One CA signs the serving certificate (127.0.0.1 and localhost: the API server, controller manager and
scheduler serve with it, and local webhook servers can) and the client certificates: the admin (``O=system:masters``, so RBAC lets it do anything) and any
user a test asks for (``client_certificate``), which is how RBAC is tested with a real identity. A separate
RSA key pair signs service-account tokens. Everything is written as PEM files into the cluster folder.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=30)


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.dir / "serving.crt"

    @property
    def serving_key(self) -> Path:
        return self.dir / "serving.key"

    @property
    def service_account_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.dir / "sa.pub"

    def serving_certificate(
        self, name: str, ips: tuple[str, ...] = (), dns: tuple[str, ...] = ()
    ) -> tuple[Path, Path]:
        """(cert, key) files of another server (a kubelet, say) for these addresses and names."""
        cert, key = self.dir / f"serving-{name}.crt", self.dir / f"serving-{name}.key"
        if not cert.exists():
            subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
            _issue(self, subject, cert, key, server=True, ips=ips, dns=dns)
        return cert, key

    def client_certificate(self, user: str, groups: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """(cert, key) files for a client that authenticates as ``user`` in ``groups``."""
        cert, key = self.dir / f"client-{user}.crt", self.dir / f"client-{user}.key"
        if not cert.exists():
            names = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
            names.append(x509.NameAttribute(NameOID.COMMON_NAME, user))
            _issue(self, x509.Name(names), cert, key, server=False)
        return cert, key


def make_pki(directory: Path, serving_ips: tuple[str, ...] = (), serving_dns: tuple[str, ...] = ()) -> Pki:
    """The CA, the control plane's serving certificate (127.0.0.1 and localhost, plus ``serving_ips`` and
    ``serving_dns``: with a real node, pods reach the API server by the node's address and the ``kubernetes``
    Service's IP and names), the admin's client certificate and the service-account key pair."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "harnessrl-test-ca")])
    now = datetime.datetime.now(datetime.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(pki.ca_key, ca_key)
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _issue(
        pki,
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]),
        pki.serving_cert,
        pki.serving_key,
        server=True,
        ips=serving_ips,
        dns=serving_dns,
    )
    pki.client_certificate("admin", ("system:masters",))
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.service_account_key, sa_key)
    pki.service_account_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def _issue(
    pki: Pki,
    subject: x509.Name,
    cert_path: Path,
    key_path: Path,
    *,
    server: bool,
    ips: tuple[str, ...] = (),
    dns: tuple[str, ...] = (),
) -> None:
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                if server
                else [ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(name) for name in dict.fromkeys(("localhost", *dns))]
                + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys(("127.0.0.1", *ips))]
            ),
            critical=False,
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def kubeconfig(server: str, pki: Pki, user: str, cert: Path, key: Path) -> dict:
    """A kubeconfig document (as a dict) for ``user`` at ``server``, trusting the cluster's CA."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "harnessrl-test",
                "cluster": {"server": server, "certificate-authority": str(pki.ca_cert)},
            }
        ],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": user, "context": {"cluster": "harnessrl-test", "user": user}}],
        "current-context": user,
    }
