"""End-to-end KV integrity: a slice's digest and its transfer's epoch, and the kinds of damage a
receiver refuses (each fails its transfer and is counted in
`pdserve_kv_integrity_failures_total{transport,kind}`).

The sender's thread computes the digest of a slice's raw bytes as it sends it (on the device for
a CUDA tensor: only the 8-byte result comes to the host); the receiving thread recomputes it on
the bytes that landed, before the KV loader may copy them into the cache. One function, plain
torch integer arithmetic, gives bit-identical results on CPU and CUDA, so either side may be on
either device. Integer sums are exact and order-free, so the device's reduction order does not
matter.

Plain torch: no vLLM, HTTP or routing here.
"""

import functools
import hashlib
import warnings
from enum import StrEnum

import torch

WORDS_PER_ROW = 512  # the digest's two-level sum: rows of this many 64-bit words (4 KiB)
_MASK = (1 << 64) - 1
_ODD = 0x9E3779B97F4A7C15  # odd: a change of s1 alone always changes the digest
_EVEN = 0xC2B2AE3D27D4EB4E  # even: see slice_digest
_LENGTH = 0x165667B19E3779F9


class Damage(StrEnum):
    """What a receiver found wrong with a slice (the metric's `kind` label)."""

    DIGEST = "digest"  # its bytes are not those the sender sent (a flipped bit, lost bytes)
    LENGTH = "length"  # not as many bytes as its blocks and heads need (truncated)
    STALE = "stale"  # produced for another transfer (a cancelled, retried or migrated one)
    DUPLICATE = "duplicate"  # a slice of this transfer that was already received
    ORDER = "order"  # a slice came before one the sender sent earlier (reordered, or lost)


def slice_digest(data: torch.Tensor) -> int:
    """A 64-bit digest of the raw bytes of `data` (any dtype, any device, contiguous).

    The bytes are read as n 64-bit words w_1..w_n (zero-padded), and two sums are taken in
    wrapping 64-bit integers: s1 = sum(w_i) and s2 = sum(i * w_i). The digest is
    s1 * ODD + s2 * EVEN + bytes * LENGTH (mod 2^64). Why it catches what a transport can do:
    - a bit flip changes one word by +-2^b (b < 64): the digest changes by 2^b * (ODD + i *
      EVEN), an odd number times 2^b, never 0 mod 2^64: every single flipped bit is caught
      (several escape only if they cancel in both sums at once);
    - reordering (words, chunks or rows swapped) leaves s1 alone but changes s2 by
      (w_i - w_j)(j - i), times EVEN = 2 * odd: 0 mod 2^64 only if that product is divisible by
      2^63, i.e. the two words differ by a multiple of a huge power of two;
    - truncation or lost bytes change the byte count, mixed in on its own (and the sums).
    It is not cryptographic: it guards against accidents, not an adversary (the cluster
    secret keeps strangers out). s2 is computed as C * sum_r(r * rowsum_r) + sum_c((c + 1) *
    colsum_c) over rows of C words: the data is read twice, in native 64-bit sums (~7-10 GB/s
    on one CPU core here), with no temporary as large as the slice."""
    flat = data.reshape(-1).view(torch.uint8)
    if flat.storage_offset() % 8:  # a 64-bit view needs aligned memory
        flat = flat.clone()
    size = flat.numel()
    row_bytes = 8 * WORDS_PER_ROW
    whole = size // row_bytes * row_bytes
    rows = flat[:whole].view(torch.int64).view(-1, WORDS_PER_ROW)
    row_sums = rows.sum(1)
    col_sums = rows.sum(0)
    if whole < size:  # the tail, zero-padded to one more row
        tail = torch.zeros(row_bytes, dtype=torch.uint8, device=flat.device)
        tail[: size - whole] = flat[whole:]
        words = tail.view(torch.int64)
        row_sums = torch.cat([row_sums, words.sum().reshape(1)])
        col_sums = col_sums + words
    row_weights, col_weights = _weights(row_sums.numel(), str(flat.device))
    mixed = (row_sums * row_weights).sum() + (col_sums * col_weights).sum()  # wraps mod 2^64
    return (int(mixed.item()) + size * _LENGTH) & _MASK


def block_digests(rows: torch.Tensor) -> torch.Tensor:
    """Each row's `slice_digest`, as the int64 with the same bits (what a pool slot's header
    holds), for a [n, bytes] uint8 tensor: one batch of tensor ops over all n rows, and the
    result stays where `rows` is. On a device nothing comes to the host: a caller compares the
    digests there, or copies them out asynchronously (kv_transfer/pool/copy.py), so no row costs
    a synchronisation. Bit-identical to `slice_digest` of each row: a row is zero-padded to whole
    rows of WORDS_PER_ROW words, as `slice_digest` pads its tail."""
    if rows.dim() != 2:
        raise ValueError(f"rows of bytes, not a tensor of shape {tuple(rows.shape)}")
    rows = rows.view(torch.uint8) if rows.dtype != torch.uint8 else rows
    count, size = rows.shape
    row_bytes = 8 * WORDS_PER_ROW
    words_rows = max(1, -(-size // row_bytes))
    padded = words_rows * row_bytes
    if padded != size or not rows.is_contiguous() or rows.storage_offset() % 8:
        whole = torch.zeros((count, padded), dtype=torch.uint8, device=rows.device)
        whole[:, :size] = rows
        rows = whole
    words = rows.view(torch.int64).view(count, words_rows, WORDS_PER_ROW)
    row_weights, col_weights = _weights(words_rows, str(rows.device))
    mixed = (words.sum(2) * row_weights).sum(1) + (words.sum(1) * col_weights).sum(1)
    return mixed + _signed(size * _LENGTH & _MASK)  # wraps mod 2^64, as slice_digest's


def prepare_block_digests(size: int, device) -> None:
    """Make `block_digests`' constants for rows of `size` bytes on `device` now (a copy to the
    device, once): a caller that must not wait for the device later calls this first."""
    _weights(max(1, -(-size // (8 * WORDS_PER_ROW))), str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _weights(rows: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ODD * s1 + EVEN * s2 as one weighted sum of the row and column sums (mod 2^64): row r
    weighs ODD + EVEN * C * r, column c weighs EVEN * (c + 1). Made once per slice size: a
    receiving thread's every torch call may wait for the GIL, so the digest makes few."""
    row_weights = torch.arange(rows, dtype=torch.int64) * _signed(
        _EVEN * WORDS_PER_ROW & _MASK
    ) + _signed(_ODD)
    col_weights = torch.arange(1, WORDS_PER_ROW + 1, dtype=torch.int64) * _signed(_EVEN)
    return row_weights.to(device), col_weights.to(device)


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def transfer_epoch(transfer_id: str) -> int:
    """The identity every slice of a transfer carries, checked against the decode worker's
    reservation for `transfer_id`. The router gives every attempt (a retry, a migration) a
    transfer id of its own, so a slice left over from a cancelled or earlier attempt (or one a
    sender put under the wrong transfer) carries another epoch and is refused. Nonzero: 0 means
    "none" on the wire."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1


def as_tensor(data) -> torch.Tensor:
    """A received slice's bytes as a flat uint8 tensor, without a copy (a bytearray, a read-only
    view of a shared-memory segment, or a tensor); only read, never written."""
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only segment view: torch warns it is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)
