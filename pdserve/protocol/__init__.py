"""The router <-> worker gRPC protocol: worker.proto, its generated modules, channel options."""

MAX_MESSAGE_BYTES = 16 << 20
# A Session's request runs at most this many chunks ahead of what its router has taken (the
# router's Credit messages): worker.proto's Credit.
CREDIT_WINDOW = 64

# Both ends raise gRPC's 4 MiB default message limit, and keep idle connections checked.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.so_reuseport", 0),  # a port in use is an error, never a shared listener
]
