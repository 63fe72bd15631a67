"""A weight version as what changed since the one before it: the encoding of one bucket, bit-exact.

An RL step moves most parameters by less than one bf16 step, so most bf16 elements of a version are the
bytes of the previous one (published measurements: 1-3% change per step at the learning rates RL uses).
A bucket is compared with the previous version's in 2-byte words (a bf16 element, half a float32 one; the
padding between tensors never changes) and sent in whichever of four forms is smallest:

* ``same``: no word changed; nothing is sent and the receiver keeps its bucket.
* ``sparse``: how many words changed and how many bytes their positions take (two int32), the positions as
  the gaps between them in LEB128 (7 bits a byte: one byte while changes lie less than 128 words apart), then
  the changed words' values: about 3 bytes per change.
  Measured on a 0.5B-shaped model at an RL learning rate (4% of the words changed): 6% of the bucket's bytes,
  where int32 positions took 12% and the bitmap 10%.
* ``bitmap``: one bit per word (set: changed), then the changed words' values: n/8 + 2 bytes per change.
  Smaller than ``sparse`` from about one word in eight changed, smaller than ``full`` up to about 94%.
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


def _gap_bytes(gaps: torch.Tensor) -> torch.Tensor:
    """LEB128 length of each gap (1 to 5 bytes: a bucket holds fewer than 2**35 words)."""
    return 1 + sum((gaps >= 1 << (7 * j)).long() for j in range(1, 5))  # type: ignore[return-value]


def _gaps(positions: torch.Tensor) -> torch.Tensor:
    """The words skipped before each changed one (positions sorted, the first counted from word 0)."""
    previous = torch.cat([positions.new_full((1,), -1), positions[:-1]])
    return positions - previous - 1


def sizes(mask: torch.Tensor) -> dict[int, int]:
    """Bytes one bucket's change (`mask`: bool per word) takes in each encoding."""
    words, changed = mask.numel(), int(mask.sum())
    if changed == 0:
        return {SAME: 0}
    varint = int(_gap_bytes(_gaps(mask.nonzero().squeeze(1))).sum())
    return {FULL: 2 * words, SPARSE: 8 + varint + varint % 2 + 2 * changed, BITMAP: words // 8 + 2 * changed}


def choose(candidates: dict[int, int]) -> int:
    """The smallest encoding among `candidates` (``sizes``); ``full`` on ties: it needs no work on either side."""
    return min(candidates, key=lambda e: (candidates[e], e != FULL))


def encode(mask: torch.Tensor, new_words: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Encode one bucket: `mask` (bool per word: changed) over `new_words` (the bucket's new words). Returns
    the encoding and its payload (uint8; empty for ``same`` and ``full``, whose bytes are the bucket's own)."""
    candidates = sizes(mask)
    encoding = choose(candidates)
    size = candidates[encoding] if encoding in (SPARSE, BITMAP) else 0
    payload = torch.empty(size, dtype=torch.uint8, device=mask.device)
    if encoding == SPARSE:
        positions = mask.nonzero().squeeze(1)
        gaps = _gaps(positions)
        lengths = _gap_bytes(gaps)
        varint = int(lengths.sum())
        payload[:8].view(torch.int32).copy_(torch.tensor([positions.numel(), varint], dtype=torch.int32))
        starts = torch.cumsum(lengths, 0) - lengths
        for level in range(int(lengths.max())):
            more = lengths > level
            byte = ((gaps[more] >> (7 * level)) & 0x7F) | ((lengths[more] > level + 1).long() << 7)
            payload[8 + starts[more] + level] = byte.to(torch.uint8)
        payload[8 + varint:8 + varint + varint % 2] = 0
        payload[8 + varint + varint % 2:].view(torch.int16).copy_(new_words[positions])
    elif encoding == BITMAP:
        nbits = mask.numel() // 8
        bits = mask.view(-1, 8).to(torch.uint8) * _BIT_VALUES.to(mask.device)
        payload[:nbits].copy_(bits.sum(dim=1, dtype=torch.uint8))
        payload[nbits:].view(torch.int16).copy_(new_words[mask])
    return encoding, payload


def _positions(payload: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A ``sparse`` payload's changed positions, and the byte its values start at."""
    changed, varint = (int(x) for x in payload[:8].view(torch.int32))
    data = payload[8:8 + varint].long()
    ends = (data & 0x80) == 0  # a gap's last byte
    gap_of = torch.cumsum(ends.long(), 0) - ends.long()
    first = torch.ones_like(ends)
    first[1:] = ends[:-1]
    level = torch.arange(varint, device=data.device) - first.nonzero().squeeze(1)[gap_of]
    gaps = torch.zeros(changed, dtype=torch.long, device=data.device).index_add_(0, gap_of,
                                                                                (data & 0x7F) << (7 * level))
    return torch.cumsum(gaps + 1, 0) - 1, 8 + varint + varint % 2


def apply(bucket_words: torch.Tensor, encoding: int, payload: torch.Tensor) -> None:
    """Bring a receiver's bucket (its words, the previous version) to the new version, in place."""
    if encoding == SPARSE:
        positions, values = _positions(payload)
        bucket_words[positions] = payload[values:].view(torch.int16)
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
