"""Text checks shared by every parser of untrusted input."""

from __future__ import annotations

__all__ = ["is_decimal"]


def is_decimal(text: str) -> bool:
    """``text`` is ASCII digits only, so ``int(text)`` takes it: ``str.isdigit`` alone is also
    true for ``"²"`` and other Unicode digits ``int`` refuses, which turned a hostile label,
    port or header into an untyped ``ValueError``."""
    return text.isascii() and text.isdigit()
