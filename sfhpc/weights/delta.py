"""A weight version as what changed since the one before it: the encoding of one bucket, bit-exact.

An RL step moves most parameters by less than one bf16 step, so most bf16 elements of a version are the
bytes of the previous one (published measurements: 1-3% change per step at the learning rates RL uses).
A bucket is compared with the previous version's in 2-byte words (a bf16 element, half a float32 one; the
padding between tensors never changes) and sent in whichever of four forms is smallest:

* ``same``: no word changed; nothing is sent and the receiver keeps its bucket.
* ``sparse``: the changed words' positions (int32) then their values: 6 bytes per changed word.
* ``bitmap``: one bit per word (set: changed), then the changed words' values: n/8 + 2 bytes per change.
  Smaller than ``sparse`` from about 3% of the words changed, smaller than ``full`` up to about 94%.
* ``full``: the bucket as it is (sent straight from the publisher's staging, received straight into the
  receiver's copy).

A receiver applies a delta to its own copy of the previous version, so it must hold every version before:
the members of one broadcast group do (every version reaches each of them). Each bucket that changed
travels with a checksum of its new bytes, which the receiver compares after applying it.
"""

from __future__ import annotations

import torch

SAME, FULL, SPARSE, BITMAP = 0, 1, 2, 3
ENCODINGS = ("same", "full", "sparse", "bitmap")
ALIGN = 64  # each encoded bucket starts this aligned in a payload buffer, so its int32 positions are too
_BIT_VALUES = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def words(buffer: torch.Tensor) -> torch.Tensor:
    """The 2-byte words of a uint8 bucket (its size is even: buckets are 64-byte aligned)."""
    return buffer.view(torch.int16)


def encoded_size(encoding: int, changed: int, bucket_words: int) -> int:
    """Bytes a bucket of `bucket_words` words with `changed` changed ones takes in `encoding`."""
    return {SAME: 0, FULL: 2 * bucket_words, SPARSE: 6 * changed, BITMAP: bucket_words // 8 + 2 * changed}[encoding]


def choose(changed: int, bucket_words: int) -> int:
    """The smallest encoding of a bucket (``full`` on ties: it needs no work on either side)."""
    if changed == 0:
        return SAME
    return min((FULL, SPARSE, BITMAP), key=lambda e: (encoded_size(e, changed, bucket_words), e != FULL))


def encode(mask: torch.Tensor, new_words: torch.Tensor, out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """Encode one bucket: `mask` (bool per word: changed) over `new_words` (the bucket's new words). Returns
    the encoding and its payload (uint8; empty for ``same`` and ``full``, whose bytes are the bucket's own),
    written into `out` when given (it must hold `encoded_size` bytes)."""
    changed = int(mask.sum())
    encoding = choose(changed, mask.numel())
    size = encoded_size(encoding, changed, mask.numel()) if encoding in (SPARSE, BITMAP) else 0
    payload = out[:size] if out is not None else torch.empty(size, dtype=torch.uint8, device=mask.device)
    if encoding == SPARSE:
        positions = mask.nonzero().squeeze(1).to(torch.int32)
        payload[:4 * changed].view(torch.int32).copy_(positions)
        payload[4 * changed:].view(torch.int16).copy_(new_words[positions.long()])
    elif encoding == BITMAP:
        nbits = mask.numel() // 8
        bits = mask.view(-1, 8).to(torch.uint8) * _BIT_VALUES.to(mask.device)
        payload[:nbits].copy_(bits.sum(dim=1, dtype=torch.uint8))
        payload[nbits:].view(torch.int16).copy_(new_words[mask])
    return encoding, payload


def apply(bucket_words: torch.Tensor, encoding: int, payload: torch.Tensor) -> None:
    """Bring a receiver's bucket (its words, the previous version) to the new version, in place."""
    if encoding == SPARSE:
        changed = payload.numel() // 6
        positions = payload[:4 * changed].view(torch.int32).long()
        bucket_words[positions] = payload[4 * changed:].view(torch.int16)
    elif encoding == BITMAP:
        nbits = bucket_words.numel() // 8
        mask = (payload[:nbits].unsqueeze(1) & _BIT_VALUES.to(payload.device)).ne(0).view(-1)
        bucket_words[mask] = payload[nbits:].view(torch.int16)
    elif encoding == FULL:
        bucket_words.copy_(payload.view(torch.int16))
    elif encoding != SAME:
        raise ValueError(f"unknown bucket encoding {encoding}")


def checksum(bucket: torch.Tensor) -> int:
    """A position-sensitive checksum of a uint8 bucket (Fletcher's, over 8-byte words, modulo 2**63): any word
    changed, lost or written at another position changes it. Computed where the bucket lies (GPU or host), in
    integer arithmetic, so the source's and each receiver's agree bit for bit."""
    values = bucket.view(torch.int64)
    first = int(values.sum())
    second = int(values.cumsum(0).sum())
    return (first * 1_000_003 + second) & ((1 << 63) - 1)
