"""Make TLS folders for a pdserve cluster (see pdserve/settings/tls.py): one CA, and per member a
folder
with ca.pem, cert.pem and key.pem, the certificate naming `pdserve` and signed by the CA.

    python scripts/make_tls_dir.py OUT [--members N] [--days D]

writes OUT/ca-key.pem (keep it away from the cluster), OUT/member-0 ... OUT/member-N-1 (give
each host one, and point `--tls-dir` at it). Needs the `cryptography` package. For production,
issue the same shape of certificates from your own CA (e.g. cert-manager on Kubernetes).
"""

import argparse
import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TARGET_NAME = "pdserve"  # pdserve/settings/tls.py's: what every member's certificate names


def _pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(subject: str, key, issuer: str, signer, days: int, is_ca: bool):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(TARGET_NAME)]), critical=False
        ).add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    return builder.sign(signer, hashes.SHA256())


def make_tls_dirs(out: Path, members: int = 1, days: int = 365) -> list[Path]:
    """The CA in `out`, and one member folder per member; returns the member folders."""
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("pdserve cluster CA", ca_key, "pdserve cluster CA", ca_key, days, True)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    _write_private(out / "ca-key.pem", _pem(ca_key))
    folders = []
    for index in range(members):
        folder = out / f"member-{index}"
        folder.mkdir(exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(TARGET_NAME, key, "pdserve cluster CA", ca_key, days, False)
        (folder / "ca.pem").write_bytes(ca_pem)
        (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(folder / "key.pem", _pem(key))
        folders.append(folder)
    return folders


def _write_private(path: Path, data: bytes) -> None:
    """Write a key readable by its owner only from its creation (a write, then a chmod, left
    it readable by others meanwhile: security review L2)."""
    path.unlink(missing_ok=True)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
        file.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--members", type=int, default=1)
    parser.add_argument("--days", type=int, default=365)
    args = parser.parse_args()
    for folder in make_tls_dirs(args.out, args.members, args.days):
        print(f"--tls-dir {folder}")


if __name__ == "__main__":
    main()
