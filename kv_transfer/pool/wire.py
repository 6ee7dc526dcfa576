"""What a pool store and its clients agree on at the socket: the address form, the hello's size,
the peer namespace. Both sides import it; neither imports the other for it."""

HELLO_BYTES = 4096  # a hello answer fits (it is read with the descriptor, in one recv)
PEER = "*"  # a hello's namespace that takes the pool's own (kv_transfer/pool/peer.py)


def socket_address(address: str) -> str:
    """ "@name" is the abstract socket "\\0name"; anything else is a path."""
    return "\0" + address[1:] if address.startswith("@") else address
