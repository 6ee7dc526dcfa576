"""FlexConnector: both KV directions in one engine, for a worker that can play either role.

    kv_transfer_config = {"kv_connector": "FlexConnector",
                          "kv_connector_module_path": "pdserve.worker.flex_connector",
                          "kv_role": "kv_both", ...both halves' extra config...}

It is the prefill half (prefill_workers/) and the decode half (decode_workers/) together: each
request's own params say what it does (`SendKv`: push its prompt's KV; `ReceiveKv`: wait for
it; neither: a plain request), so the worker's role is only which legs the router sends it, and
changing it needs no engine restart. Both halves run their scheduler and worker parts side by
side; the KV receiver listens from the start.
"""

from dataclasses import replace

from decode_workers.connector import DecodeConnector
from prefill_workers.connector import PrefillConnector


class FlexConnector(PrefillConnector, DecodeConnector):
    """Method resolution runs the prefill half, then the decode half, then the shared base:
    every hook both halves answer (init, cache registration, request_finished) calls on with
    super(); the two that return a value or stop things are joined here, each from what its
    halves return (a step's metadata: the decode half's, with the prefill half's sends), so a
    field either half adds reaches the worker (seen: the decode half's `abandoned` transfers
    were dropped, and reached the worker as never held)."""

    def build_connector_meta(self, scheduler_output):
        receiving = DecodeConnector.build_connector_meta(self, scheduler_output)
        sending = PrefillConnector.build_connector_meta(self, scheduler_output)
        return replace(receiving, sends=sending.sends)

    def shutdown(self):
        PrefillConnector.shutdown(self)
        DecodeConnector.shutdown(self)
