"""Mutual TLS inside a rendered cluster (`pdserve k8s render --tls-secret`, and optionally
`--tls-issuer` for cert-manager to make and renew the Secret): every pdserve container mounts the
Secret where PDSERVE_TLS_DIR points (pdserve/settings/tls.py), so the router's calls, the KV
streams and the cancels between pods all use it.

The Secret has cert-manager's keys (`ca.crt`, `tls.crt`, `tls.key`), mounted as the files pdserve
reads; one certificate for the whole cluster, naming `pdserve` (what every member checks). From
scripts/make_tls_dir.py's folder: `kubectl create secret generic pdserve-tls
--from-file=ca.crt=ca.pem --from-file=tls.crt=cert.pem --from-file=tls.key=key.pem`. Certificates
are read when a process starts: after a renewal, restart the pods (`kubectl rollout restart`).

The files are mode 0440 (the Secret volume's default is 0644): root, which owns them, and the pod's
fsGroup, the group pdserve's processes run as, read them; no other user of the container does.

Kubelet's gRPC probes speak no TLS, so a worker then also answers grpc.health.v1, and only that,
in plaintext on HEALTH_PORT, and its probes ask there."""

from pdserve.cluster.k8s.objects import metadata
from pdserve.settings.base import ConfigError
from pdserve.settings.tls import TARGET_NAME, TLS_DIR_ENV

MOUNT = "/etc/pdserve-tls"
VOLUME = "tls"
FILES = {"ca.crt": "ca.pem", "tls.crt": "cert.pem", "tls.key": "key.pem"}
CERTIFICATE_SECRET = "pdserve-tls"  # the Secret --tls-issuer's Certificate writes by default
HEALTH_PORT = 50052
MODE = 0o440  # the key: its owner (root) and the pod's group (fsGroup, pdserve's uid) read it
ISSUER_KINDS = ("Issuer", "ClusterIssuer")


def with_tls(spec: dict, secret: str) -> dict:
    """`spec` (a pod spec) with its containers using the cluster's TLS folder from `secret`;
    unchanged when `secret` is empty."""
    if not secret:
        return spec
    items = [{"key": key, "path": path} for key, path in FILES.items()]
    secret_volume = {"secretName": secret, "items": items, "defaultMode": MODE}
    volume = {"name": VOLUME, "secret": secret_volume}
    spec["volumes"] = [*spec.get("volumes", []), volume]
    for container in spec["containers"]:
        mount = {"name": VOLUME, "mountPath": MOUNT, "readOnly": True}
        container["volumeMounts"] = [*container.get("volumeMounts", []), mount]
        container["env"] = [*container.get("env", []), {"name": TLS_DIR_ENV, "value": MOUNT}]
    return spec


def parse_issuer(issuer: str) -> tuple[str, str]:
    """`Issuer/NAME` or `ClusterIssuer/NAME` -> (kind, name)."""
    kind, _, name = issuer.partition("/")
    if kind not in ISSUER_KINDS or not name:
        raise ConfigError(f"--tls-issuer {issuer!r}: expected Issuer/NAME or ClusterIssuer/NAME")
    return kind, name


def certificate(issuer: str, secret: str) -> dict:
    """cert-manager's Certificate for the cluster: one key pair that serves and calls, signed by
    `issuer` (a CA issuer: its ca.crt lands in the Secret too, which every member trusts)."""
    kind, name = parse_issuer(issuer)
    return {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": metadata(CERTIFICATE_SECRET, "tls"),
        "spec": {
            "secretName": secret,
            "commonName": TARGET_NAME,
            "dnsNames": [TARGET_NAME],
            "usages": ["server auth", "client auth", "digital signature", "key encipherment"],
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "issuerRef": {"group": "cert-manager.io", "kind": kind, "name": name},
        },
    }
