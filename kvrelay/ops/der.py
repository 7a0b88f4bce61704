"""The one DER reader of the TLS code: enough of X.690 to walk certificates and CRLs.

The standard library loads certificates and CRLs into OpenSSL but hands back next to nothing of
them, so what the relay must know itself (a certificate's CN and expiry, a CRL's issuer and
serials, a CRL's signature) is read here: definite lengths, one-byte tags (all X.509 uses).
"""

from __future__ import annotations


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
