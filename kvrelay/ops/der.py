"""The one DER reader of the TLS code: enough of X.690 to walk certificates and CRLs.

The standard library loads certificates and CRLs into OpenSSL but hands back next to nothing of
them, so what the relay must know itself (a certificate's CN and expiry, a CRL's issuer and
serials, a CRL's signature) is read here: definite lengths, one-byte tags (all X.509 uses).
"""

from __future__ import annotations

import contextlib

#: One attribute of a Name as compared: its type's OID bytes and its value, a canonical string
#: (``name_key``) or, for a value of another type, its whole DER element.
NameKey = tuple[tuple[tuple[bytes, str | bytes], ...], ...]

#: The string types a Name's value is compared as text in (what OpenSSL canonicalizes), and the
#: codec each is read with: UTF8String, PrintableString, TeletexString (Latin-1, as OpenSSL
#: reads it), IA5String, VisibleString, UniversalString, BMPString.
_TEXT_TYPES = {
    0x0C: "utf-8", 0x13: "latin-1", 0x14: "latin-1", 0x16: "latin-1", 0x1A: "latin-1",
    0x1C: "utf-32-be", 0x1E: "utf-16-be",
}  # fmt: skip
#: (the one-byte types are read a byte a character, as OpenSSL reads them, whatever byte is
#: there; a value that does not decode in its type is compared as its bytes: never an error)
_SPACE = " \t\n\v\f\r"


def tlv(buf: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, value start, value end) of the DER element at ``pos``; ``ValueError`` (or
    ``IndexError``) when it is not one."""
    tag = buf[pos]
    n = buf[pos + 1]
    pos += 2
    if n & 0x80:
        k = n & 0x7F
        if not 1 <= k <= 4:
            raise ValueError("bad DER length")
        n = int.from_bytes(buf[pos : pos + k], "big")
        pos += k
    if pos + n > len(buf):
        raise ValueError("truncated DER")
    return tag, pos, pos + n


def elements(der: bytes, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """(tag, element start, value start, value end) of each DER element in ``der[start:end]``."""
    out = []
    pos = start
    while pos < end:
        tag, vstart, vend = tlv(der, pos)
        if vend > end:
            raise ValueError("DER element runs past its parent")
        out.append((tag, pos, vstart, vend))
        pos = vend
    return out


def tbs_fields(der: bytes) -> list[tuple[int, int, int, int]]:
    """The fields of a certificate's tbsCertificate, the optional explicit version left out
    (RFC 5280 §4.1: serial, signature, issuer, validity, subject, subjectPublicKeyInfo, ...)."""
    _t, cert, _e = tlv(der, 0)
    _t, pos, end = tlv(der, cert)  # tbsCertificate
    fields = [f for f in elements(der, pos, end) if f[0] != 0xA0]
    if len(fields) < 6:
        raise ValueError("short tbsCertificate")
    return fields


def _canonical_text(text: str) -> str:
    """A Name's text as OpenSSL compares it: whitespace trimmed, each inner run of it one
    space, ASCII letters lower-cased (others as they are)."""
    words = text.strip(_SPACE)
    out = []
    space = False
    for ch in words:
        if ch in _SPACE:
            space = True
            continue
        if space:
            out.append(" ")
            space = False
        out.append(ch.lower() if ch.isascii() else ch)
    return "".join(out)


def name_key(der: bytes, start: int, end: int) -> NameKey:
    """The Name whose value is ``der[start:end]`` (a SEQUENCE of SETs of {oid, value}) in the
    form names are compared in: each text value canonical (``_canonical_text``) whichever
    string type encodes it, each multi-valued RDN's attributes in one order. Two encodings of
    one name (a CA's subject as UTF8String, the issuer of a CRL or certificate it signed as
    PrintableString) then compare equal, as OpenSSL (RFC 5280 §7.1) finds them equal; raw bytes
    did not."""
    rdns = []
    for _t, _p, rs, re_ in elements(der, start, end):
        attrs = []
        for _t2, _p2, as_, ae in elements(der, rs, re_):
            _t3, os_, oe = tlv(der, as_)
            vtag, vs, ve = tlv(der, oe)
            if ve != ae:
                raise ValueError("attribute with more than a type and a value")
            codec = _TEXT_TYPES.get(vtag)
            value: str | bytes = der[oe:ve]
            if codec is not None:
                with contextlib.suppress(UnicodeDecodeError):
                    value = _canonical_text(der[vs:ve].decode(codec))
            attrs.append((der[os_:oe], value))
        rdns.append(tuple(sorted(attrs, key=lambda a: (a[0], isinstance(a[1], bytes), a[1]))))
    return tuple(rdns)
