"""Optional mutual TLS on every gRPC channel inside the cluster (router -> worker, KV streams
and cancels), for clusters whose hosts talk over networks that are not private.

One folder holds the cluster's CA certificate and this member's certificate and key (`ca.pem`,
`cert.pem`, `key.pem`; scripts/make_tls_dir.py makes one). Servers then accept only clients
whose certificate the CA signed, and clients check the server's. Members are reached by address
(IPs change), so every certificate names the cluster, not the host: `pdserve` (TARGET_NAME) in
its subject alternative names, and clients check that name.

The folder comes from `--tls-dir` or PDSERVE_TLS_DIR, which a worker's engine processes (where
the KV connections are made) inherit. Without it every channel is plaintext, as before. NCCL's
own traffic is not covered (NCCL has no TLS), nor is shm (it never leaves the host).
"""

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.settings.config_error import ConfigError

TLS_DIR_ENV = "PDSERVE_TLS_DIR"
TARGET_NAME = "pdserve"  # the DNS name in every member's certificate
FILES = ("ca.pem", "cert.pem", "key.pem")


@dataclass(frozen=True)
class TlsFiles:
    ca: bytes
    cert: bytes
    key: bytes


def load_tls_dir(path: str) -> None:
    """Check the folder (if given) and put it in this process's environment, for the engine
    processes it starts; ConfigError naming what is missing."""
    if not path:
        return
    missing = [name for name in FILES if not (Path(path) / name).is_file()]
    if missing:
        raise ConfigError(f"--tls-dir {path}: missing {', '.join(missing)}")
    os.environ[TLS_DIR_ENV] = str(Path(path).resolve())


def cluster_tls() -> TlsFiles | None:
    """This process's TLS files, or None for plaintext."""
    folder = os.environ.get(TLS_DIR_ENV, "")
    return _read(folder) if folder else None


@functools.cache
def _read(folder: str) -> TlsFiles:
    return TlsFiles(*(Path(folder, name).read_bytes() for name in FILES))


def add_port(server, address: str) -> int:
    """Listen on `address` (grpc.server or grpc.aio.server), with TLS when the cluster has it;
    returns the port (0 when it cannot listen)."""
    tls = cluster_tls()
    if tls is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True
    )
    return server.add_secure_port(address, credentials)


def _secure(options) -> tuple[grpc.ChannelCredentials, list]:
    tls = cluster_tls()
    credentials = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
    return credentials, [*options, ("grpc.ssl_target_name_override", TARGET_NAME)]


def channel(address: str, options=()) -> grpc.Channel:
    """A blocking channel to a cluster member."""
    if cluster_tls() is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, *_secure(options))


def aio_channel(address: str, options=()) -> grpc.aio.Channel:
    """An asyncio channel to a cluster member."""
    if cluster_tls() is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, *_secure(options))
