"""Typed pool errors. Kernels return small integer codes per event; Python maps them here."""

from __future__ import annotations


class PoolError(Exception):
    """Base: an event (or batch) the pool refused; state is unchanged by the refused part."""

    kind = "pool_error"


class ParentBlockNotFound(PoolError):
    kind = "parent_block_not_found"


class InvalidBlockSequence(PoolError):
    """Self-referencing store, or an external hash re-stored with a different canonical hash."""

    kind = "invalid_block_sequence"


class TokenCountMismatch(PoolError):
    """Token count is not ``k·B`` (standard) or ``k·B+1`` (Eagle) for ``k`` blocks."""

    kind = "token_count_mismatch"


class BlockSizeMismatch(PoolError):
    """The engine's block size differs from the pool's (raised by ingest, counted here too)."""

    kind = "block_size_mismatch"


class UnknownOp(PoolError):
    kind = "unknown_op"


class MalformedBatch(PoolError):
    """Batch arrays are inconsistent (lengths/offsets); the whole batch is refused."""

    kind = "malformed_batch"


class UnknownMember(PoolError):
    kind = "unknown_member"


class InvariantViolation(PoolError):
    """A resident fingerprint was not found on removal: exact state and CKF disagree."""

    kind = "invariant_violation"


# kernel code -> class (0 = ok)
E_OK = 0
E_PARENT = 1
E_INVALID_SEQ = 2
E_TOKENS = 3
E_BAD_OP = 4

CODE_TO_ERROR: dict[int, type[PoolError]] = {
    E_PARENT: ParentBlockNotFound,
    E_INVALID_SEQ: InvalidBlockSequence,
    E_TOKENS: TokenCountMismatch,
    E_BAD_OP: UnknownOp,
}

CODE_MESSAGE: dict[int, str] = {
    E_PARENT: "store parent hash is not in this member's lineage",
    E_INVALID_SEQ: "self-referencing store or conflicting re-store of an external hash",
    E_TOKENS: "token count does not match the block count for the pool's block size and format",
    E_BAD_OP: "unknown event op",
}
