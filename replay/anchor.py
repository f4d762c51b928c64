"""The journal's anchor: its last global position and the record chain digest there,
`POSITION:CHAIN_DIGEST` (`kvledger head`), optionally signed with a key the operator
holds; and what `kvledger verify --expect` makes of one.

Each record's chain digest is SHA-256(previous record's digest || SHA-256(its body))
(journal.record_format), so the digest at a position names the whole history up to it. The
chain alone shows that no record was changed in place. It cannot show that the journal
still holds every record: a rollback to an older copy, a deleted tail or an emptied
journal is a shorter chain, whole in itself. An anchor kept where the operator controls
it can: the journal must still reach its position with the same digest there.

A signed anchor is `POSITION:CHAIN_DIGEST:SIGNATURE`, the signature an HMAC-SHA256 with
the operator's key over `canonical()`. A journal stores no identity of its own; the
digest already tells one journal's history from another's (an empty journal's anchor,
position 0 and the genesis digest, is every empty journal's).
"""

from __future__ import annotations

import hashlib
import hmac
import re

import msgspec

from kvledger.journal.contract import ChainAt
from kvledger.journal.port import Journal, Snapshot
from kvledger.schemas.errors import ErrorCode, KvLedgerError

VERSION = "kvledger-anchor/1"
MIN_KEY_BYTES = 16
MAX_KEY_FILE = 1 << 16  # a key file larger than this is not a key
_MAX_POSITION = (1 << 63) - 1
_FORM = re.compile(r"(\d{1,19}):([0-9a-fA-F]{64})(?::([0-9a-fA-F]{64}))?")
_HEX_KEY = re.compile(rb"(?:[0-9a-fA-F]{2}){16,}")


class Anchor(msgspec.Struct, frozen=True):
    position: int
    chain: bytes  # 32 bytes
    signature: bytes | None = None  # HMAC-SHA256 over canonical(position, chain)

    def text(self) -> str:
        plain = f"{self.position}:{self.chain.hex()}"
        return plain if self.signature is None else f"{plain}:{self.signature.hex()}"


def parse(text: str) -> Anchor:
    """An anchor as `kvledger head` prints it; INVALID_ARGUMENT for anything else."""
    found = _FORM.fullmatch(text.strip())
    if found is None or int(found[1]) > _MAX_POSITION:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT,
                            f"--expect {shown!r} is not an anchor: POSITION:CHAIN_DIGEST (64 hex digits), "
                            "optionally :SIGNATURE, as `kvledger head` prints it")
    signature = bytes.fromhex(found[3]) if found[3] else None
    return Anchor(int(found[1]), bytes.fromhex(found[2]), signature)


def canonical(position: int, chain: bytes) -> bytes:
    """What a signature covers: the format's name, the position and the digest."""
    return f"{VERSION}\nposition {position}\nchain {chain.hex()}\n".encode()


def sign(anchor: Anchor, key: bytes) -> Anchor:
    mac = hmac.new(key, canonical(anchor.position, anchor.chain), hashlib.sha256).digest()
    return Anchor(anchor.position, anchor.chain, mac)


def read_key(path: str) -> bytes:
    """The key in `path`: hex digits (whitespace around them ignored) or raw bytes, at
    least 16 bytes. Errors name the file, never its contents."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_FILE + 1)
    except OSError as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"--key: cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_KEY_FILE:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"--key: {path} is larger than {MAX_KEY_FILE} bytes: "
                                                        "not a key file")
    key = bytes.fromhex(raw.strip().decode()) if _HEX_KEY.fullmatch(raw.strip()) else raw
    if len(key) < MIN_KEY_BYTES:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"--key: the key in {path} is {len(key)} bytes; "
                                                        f"an anchor key needs at least {MIN_KEY_BYTES}")
    return key


def current(journal: Journal) -> Anchor:
    """The journal's anchor now: its last position and the chain digest there."""
    with journal.snapshot() as snap:
        at = snap.chain_at()
    if at.chain is None:
        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"the journal's last record (position {at.position}) has "
                                                       "no chain digest (run `kvledger verify`)")
    return Anchor(at.position, at.chain)


def signature_problem(expected: Anchor, key: bytes) -> str | None:
    """Why `expected` is not an anchor signed with `key` (None: it is)."""
    if expected.signature is None:
        return ("unsigned: the anchor carries no signature, and --key checks signed ones "
                "(`kvledger head --key FILE` prints them)")
    if not hmac.compare_digest(sign(expected, key).signature or b"", expected.signature):
        return ("bad signature: the anchor's signature does not verify with --key: it was not made with "
                "this key, or the anchor was altered")
    return None


def mismatch(expected: Anchor, at: ChainAt) -> str | None:
    """How the journal (`at`: its chain at the anchor's position) fails to extend the
    anchor: emptied, a deleted tail, rolled back, or a different history (None: it
    extends it)."""
    p, last = expected.position, at.last_position
    if last < p:
        if last == 0:
            return f"emptied: the journal holds no events; the anchor is at position {p}"
        if at.named is not None and at.named > last:
            return (f"deleted tail: the journal ends at position {last}, before the anchor's {p}, and its "
                    f"head rows name records up to position {at.named}: its last records were deleted")
        return (f"rolled back: the journal ends at position {last}, before the anchor's {p}: an older copy "
                "of the database, or its last commits lost (a deleted -wal)")
    if at.chain is None:
        return f"different history: no commit of this journal ends at position {p}, the anchor's"
    if not hmac.compare_digest(at.chain, expected.chain):
        return (f"different history: the chain digest at position {p} is {at.chain.hex()[:16]}..., "
                f"the anchor says {expected.chain.hex()[:16]}...")
    return None


def check(snap: Snapshot, expect: Anchor, key: bytes | None) -> tuple[str | None, str]:
    """Whether the journal `snap` reads extends `expect` (signed with `key`, when given):
    the problem (None: none), and the outcome in one line for the report."""
    problem = None if key is None else signature_problem(expect, key)
    if problem is None:
        at = snap.chain_at(expect.position)
        problem = mismatch(expect, at)
        if problem is None:
            signed = " (signature verified)" if key is not None else ""
            return None, f"{expect.text()}: the journal extends it{signed}, to position {at.last_position}"
    return problem, f"{expect.text()}: {problem}"
