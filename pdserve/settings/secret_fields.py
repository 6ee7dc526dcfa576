"""The settings fields that name where a member's credentials are (the cluster secret's file,
the TLS folder), shared by the worker's and the router's settings. Kept apart from
cluster_secret.py and tls.py, which the KV data plane imports where pydantic is absent."""

from typing import Annotated

from pydantic import Field

from pdserve.settings.cluster_secret import SECRET_ENV
from pdserve.settings.tls import TLS_DIR_ENV

ClusterSecretFile = Annotated[
    str,
    Field(
        default="",
        description=f"a file holding the cluster secret that worker gRPC calls and KV streams "
        f"must carry (default: ${SECRET_ENV}; `serve` and `up` generate one; with neither "
        f"the cluster is open)",
        json_schema_extra={"metavar": "PATH"},
    ),
]


TlsDir = Annotated[
    str,
    Field(
        default="",
        description=f"a folder with the cluster's ca.pem and this member's cert.pem and "
        f"key.pem: every gRPC channel in the cluster uses mutual TLS (default: ${TLS_DIR_ENV}; "
        f"none: plaintext)",
        json_schema_extra={"metavar": "DIR"},
    ),
]
