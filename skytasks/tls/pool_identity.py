"""The pool's TLS identity for the relay tree between its agents (skytasks.node.peers), and the
certificate a sealed stream's controller end presents (skytasks.tls.stream_seal).

One EC P-256 key and a self-signed certificate per pool, made on the controller (the node side
has only the standard library, so it gets PEM text, never makes keys: node/tls_link.py). Every
agent of the pool presents this certificate and trusts it alone: a listener admits only a peer
that proves the pool's key, and a peer sends only to a listener that proves it too. The key
reaches each agent in its PEERS message, over the controller's own authenticated channel, and
nowhere else (no manifest, command line, environment, file or log on the controller).
"""

from __future__ import annotations

import datetime
from typing import NamedTuple


class PoolTLS(NamedTuple):
    cert: str  # PEM: the pool's certificate, each agent's identity and the only one it trusts
    key: str  # PEM (PKCS#8, unencrypted): its private key


def pool_tls() -> PoolTLS:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "skytasks pool")])
    now = datetime.datetime.now(datetime.timezone.utc)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))  # a node's clock a little behind
        .not_valid_after(now + datetime.timedelta(days=3650))  # dies with the pool, not by date
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=False,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return PoolTLS(
        cert=cert.public_bytes(serialization.Encoding.PEM).decode(),
        key=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()).decode(),
    )
