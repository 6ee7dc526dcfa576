"""What prefill and decode workers share to move KV: the connector base, the metadata and
request params, the wire format and gRPC transport, the compatibility handshake."""
