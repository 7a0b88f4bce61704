"""CURVE keys named by the configuration (``[pools.connect]``): the connect socket's secret key
and its publishers' public keys, Z85 as ``zmq.curve_keypair()`` and libzmq's ``curve_keygen``
print them. Checked here so that ``check-config``, the start and a reload refuse the same files
with the file and line named, instead of libzmq failing (or admitting) later."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from zmq.utils import z85

#: Z85 characters of a 32-byte CURVE key.
KEY_CHARS = 40
#: Public keys one file may list: far more than a pool's publishers (``max_members`` ≤ 65536
#: members, a few per engine), small enough that a wrong file (a log) is refused, not kept.
MAX_CLIENT_KEYS = 65536
#: A key file larger than this is refused unread (65,536 keys with a comment each fit).
MAX_FILE_BYTES = 16 * 1024 * 1024


class KeyFileError(ValueError):
    """A key file that does not hold what it must; the message names the file (and line)."""


def z85_key(text: str) -> bytes:
    """The 32 bytes of a Z85 CURVE key; ``ValueError`` saying why not. (pyzmq's decoder raises
    ``KeyError`` for a character outside Z85 and ``struct.error`` for a group past 2³²: both
    are refusals here, never a traceback.)"""
    if len(text) != KEY_CHARS:
        raise ValueError(f"{len(text)} characters, not {KEY_CHARS}")
    try:
        raw = z85.decode(text)
    except (ValueError, KeyError, IndexError, TypeError, struct.error):
        raise ValueError(
            "not Z85 (a character outside its alphabet, or a group past 2^32)"
        ) from None
    return raw


def read_secret_key(file: str) -> str:
    """The Z85 secret key ``file`` holds (surrounding whitespace ignored)."""
    key = _read(file).strip()
    try:
        z85_key(key)
    except ValueError as exc:
        raise KeyFileError(f"{file!r} does not hold a Z85 CURVE secret key ({exc})") from None
    return key


#: The word after a key that names the engines it may publish as.
ENGINES_PREFIX = "engines="
#: Bytes of one engine name (a connect-mode topic's engine is at most 256 bytes too).
MAX_ENGINE_NAME = 256


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """A client keys file: its keys, and for each key that names engines, those engines."""

    keys: tuple[str, ...]
    #: (key, the engines it alone may publish as) for the keys whose line names engines
    engines: tuple[tuple[str, tuple[str, ...]], ...] = ()


def read_client_keys(file: str) -> ClientKeys:
    """The Z85 public keys ``file`` lists, in file order without repeats.

    One key a line. After it, past whitespace, ``engines=a,b`` names the engines that key may
    publish as (and binds them to it: only the keys naming an engine may publish it); anything
    further, or anything else there, is a comment. Blank lines and lines beginning with ``#``
    are skipped. Z85 has ``#`` too, but no key begins with it: a key's first character stands
    for its first four bytes over 85⁴, at most 82 (``%``).
    """
    keys: dict[str, None] = {}
    engines: dict[str, dict[str, None]] = {}
    for n, line in enumerate(_read(file).splitlines(), 1):
        words = line.split(None, 2)
        if not words:
            continue
        word = words[0]
        if word.startswith("#"):
            continue
        try:
            z85_key(word)
        except ValueError as exc:
            raise KeyFileError(
                f"{file!r} line {n}: not a Z85 CURVE public key ({exc})"
            ) from None
        keys[word] = None
        if len(keys) > MAX_CLIENT_KEYS:
            raise KeyFileError(f"{file!r} line {n}: more than {MAX_CLIENT_KEYS} keys")
        if len(words) > 1 and words[1].startswith(ENGINES_PREFIX):
            names = words[1][len(ENGINES_PREFIX) :].split(",")
            bad = next((x for x in names if not _engine_name_ok(x)), None)
            if bad is not None:
                raise KeyFileError(
                    f"{file!r} line {n}: {bad!r} is not an engine name (printable, no space or "
                    f"comma, 1 to {MAX_ENGINE_NAME} bytes)"
                )
            engines.setdefault(word, {}).update(dict.fromkeys(names))
    if not keys:
        raise KeyFileError(f"{file!r} lists no key (every publisher would be refused)")
    return ClientKeys(tuple(keys), tuple((k, tuple(v)) for k, v in engines.items()))


def _engine_name_ok(name: str) -> bool:
    """(No space or comma can be in it: the line is split at both first.)"""
    return 0 < len(name.encode()) <= MAX_ENGINE_NAME and name.isprintable()


def _read(file: str) -> str:
    try:
        with open(file, encoding="ascii") as f:
            text = f.read(MAX_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read {file!r}: {exc}") from None
    if len(text) > MAX_FILE_BYTES:
        raise KeyFileError(f"{file!r} is larger than {MAX_FILE_BYTES} bytes")
    return text
