"""Checksums of stored bytes: computed by the writer from the bytes it writes, checked by readers.

New checkpoints record ``"xxh3_128:<hex>"`` (xxHash's XXH3, 128 bits: a non-cryptographic hash
that runs at memory speed and releases the GIL, so hashing adds little to a save and runs beside
training in a background save). It catches corruption and truncation, not tampering. Manifests of
the first format version recorded ``sha256``; they still verify.
"""
from __future__ import annotations

import hashlib
from typing import Optional

ALGORITHM = "xxh3_128"


class Hasher:
    """An incremental hash of the ``ALGORITHM`` (or ``algorithm``) kind; ``hexdigest()`` tags the result."""

    def __init__(self, algorithm: str = ALGORITHM):
        self.algorithm = algorithm
        if algorithm == ALGORITHM:
            import xxhash  # here, not at import: `import bigdense` must work where only torch is (bench.gpu)

            self._h = xxhash.xxh3_128()
        else:
            self._h = hashlib.new(algorithm)

    def update(self, data) -> "Hasher":
        self._h.update(data)
        return self

    def hexdigest(self) -> str:
        return f"{self.algorithm}:{self._h.hexdigest()}"


def digest_bytes(data) -> str:
    return Hasher().update(data).hexdigest()


def recorded_digest(record: dict) -> Optional[str]:
    """The tagged digest a manifest record holds (``hash``, or a first-version ``sha256``), if any."""
    if "hash" in record:
        return record["hash"]
    if "sha256" in record:
        return f"sha256:{record['sha256']}"
    return None


def matches(record: dict, data) -> bool:
    """Whether ``data`` hashes to what ``record`` says (``True`` when it records no checksum)."""
    expected = recorded_digest(record)
    if expected is None:
        return True
    algorithm = expected.split(":", 1)[0]
    return Hasher(algorithm).update(data).hexdigest() == expected


def file_matches(record: dict, path, block: int = 1 << 22) -> bool:
    expected = recorded_digest(record)
    if expected is None:
        return True
    h = Hasher(expected.split(":", 1)[0])
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest() == expected
