"""Text checks shared by every parser of untrusted input."""

from __future__ import annotations

__all__ = ["is_decimal"]


#: The most digits ``is_decimal`` takes: any unsigned 128-bit number (39), far below the 4,300
#: past which CPython's ``int(str)`` refuses a string.
MAX_DECIMAL_DIGITS = 40


def is_decimal(text: str) -> bool:
    """``text`` is at most ``MAX_DECIMAL_DIGITS`` ASCII digits, so ``int(text)`` takes it:
    ``str.isdigit`` alone is also true for ``"²"`` and other Unicode digits ``int`` refuses, and
    for a string of 4,301 digits, which ``int`` refuses as well (CPython's bound against
    quadratic conversion); either turned a hostile label, port or header into an untyped
    ``ValueError``."""
    return len(text) <= MAX_DECIMAL_DIGITS and text.isascii() and text.isdigit()
