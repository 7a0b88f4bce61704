"""Does a CRL's signature verify under a CA certificate's public key?

OpenSSL finds a CRL's CA by its issuer *name*, and refuses every client of that CA at the
handshake ("CRL signature failure") when the CRL was signed by another key: a CA re-keyed under
the same subject, a staging CA of the same name. The standard library cannot tell (it verifies
nothing it does not load), so a reload would swap in such a CRL and lock a whole fleet out at its
next reconnection. This module checks the signature before the CRL is used, from the specs:
RSASSA-PKCS1-v1_5 and RSASSA-PSS (RFC 8017), ECDSA over P-256 and P-384 (FIPS 186-4, SEC 1) and
Ed25519 (RFC 8032). Verification only: public values, so plain integer arithmetic will do.

An algorithm, curve or parameter set it does not know is ``unknown`` ("cannot verify"), never a
pass; nothing it is given makes it raise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvrelay.ops.der import elements, tbs_fields, tlv

Outcome = Literal["valid", "invalid", "unknown"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a signature check found: ``valid``, ``invalid`` (this key did not sign it), or
    ``unknown`` (an algorithm or key this module does not verify); ``detail`` says which."""

    outcome: Outcome
    detail: str


def _oid(dotted: str) -> bytes:
    """The DER contents of an OBJECT IDENTIFIER (X.690 §8.19)."""
    arcs = [int(a) for a in dotted.split(".")]
    out = bytearray([40 * arcs[0] + arcs[1]])
    for arc in arcs[2:]:
        chunk = [arc & 0x7F]
        while arc := arc >> 7:
            chunk.append(0x80 | (arc & 0x7F))
        out += bytes(reversed(chunk))
    return bytes(out)


_HASHES: dict[bytes, str] = {
    _oid("1.3.14.3.2.26"): "sha1",
    _oid("2.16.840.1.101.3.4.2.4"): "sha224",
    _oid("2.16.840.1.101.3.4.2.1"): "sha256",
    _oid("2.16.840.1.101.3.4.2.2"): "sha384",
    _oid("2.16.840.1.101.3.4.2.3"): "sha512",
}
_HASH_OID = {name: oid for oid, name in _HASHES.items()}
_RSA_KEY = _oid("1.2.840.113549.1.1.1")
_RSA_PSS = _oid("1.2.840.113549.1.1.10")  # a signature algorithm, and a key restricted to it
_MGF1 = _oid("1.2.840.113549.1.1.8")
_RSA_PKCS1: dict[bytes, str] = {
    _oid("1.2.840.113549.1.1.5"): "sha1",
    _oid("1.2.840.113549.1.1.14"): "sha224",
    _oid("1.2.840.113549.1.1.11"): "sha256",
    _oid("1.2.840.113549.1.1.12"): "sha384",
    _oid("1.2.840.113549.1.1.13"): "sha512",
}
_EC_KEY = _oid("1.2.840.10045.2.1")
_ECDSA: dict[bytes, str] = {
    _oid("1.2.840.10045.4.1"): "sha1",
    _oid("1.2.840.10045.4.3.1"): "sha224",
    _oid("1.2.840.10045.4.3.2"): "sha256",
    _oid("1.2.840.10045.4.3.3"): "sha384",
    _oid("1.2.840.10045.4.3.4"): "sha512",
}
_ED25519 = _oid("1.3.101.112")


@dataclass(frozen=True, slots=True)
class _Curve:
    """A short Weierstrass curve y² = x³ + ax + b over GF(p) with a base point of prime order n
    (cofactor 1)."""

    name: str
    p: int
    a: int
    b: int
    gx: int
    gy: int
    n: int


_CURVES: dict[bytes, _Curve] = {
    _oid("1.2.840.10045.3.1.7"): _Curve(  # P-256 (FIPS 186-4 §D.1.2.3)
        "P-256",
        p=2**256 - 2**224 + 2**192 + 2**96 - 1,
        a=2**256 - 2**224 + 2**192 + 2**96 - 4,
        b=0x5AC635D8AA3A93E7B3EBBD55769886BC651D06B0CC53B0F63BCE3C3E27D2604B,
        gx=0x6B17D1F2E12C4247F8BCE6E563A440F277037D812DEB33A0F4A13945D898C296,
        gy=0x4FE342E2FE1A7F9B8EE7EB4A7C0F9E162BCE33576B315ECECBB6406837BF51F5,
        n=0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551,
    ),
    _oid("1.3.132.0.34"): _Curve(  # P-384 (FIPS 186-4 §D.1.2.4)
        "P-384",
        p=2**384 - 2**128 - 2**96 + 2**32 - 1,
        a=2**384 - 2**128 - 2**96 + 2**32 - 4,
        b=int("B3312FA7E23EE7E4988E056BE3F82D19181D9C6EFE8141120314088F5013875A"
              "C656398D8A2ED19D2A85C8EDD3EC2AEF", 16),
        gx=int("AA87CA22BE8B05378EB1C71EF320AD746E1D3B628BA79B9859F741E082542A38"
               "5502F25DBF55296C3A545E3872760AB7", 16),
        gy=int("3617DE4A96262C6F5D9E98BF9292DC29F8F41DBD289A147CE9DA3113B5F0B8C0"
               "0A60B1CE1D7E819D7A431D7C90EA0E5F", 16),
        n=int("FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFC7634D81F4372DDF"
              "581A0DB248B0A77AECEC196ACCC52973", 16),
    ),
}


def verify_crl(crl_der: bytes, ca_der: bytes) -> Verdict:
    """Whether the CA certificate's key signed the CRL (RFC 5280 §5.1: CertificateList =
    tbsCertList, signatureAlgorithm, signatureValue; the signature is over tbsCertList's DER)."""
    try:
        _t, start, end = tlv(crl_der, 0)
        parts = elements(crl_der, start, end)
        if len(parts) != 3 or parts[0][0] != 0x30 or parts[1][0] != 0x30:
            raise ValueError("not a CertificateList")
        tbs = crl_der[parts[0][1] : parts[0][3]]
        algorithm = crl_der[parts[1][1] : parts[1][3]]
        signature = _bit_string(crl_der, parts[2])
    except (ValueError, IndexError) as exc:
        return Verdict("invalid", f"unreadable CRL structure ({exc})")
    try:
        _t, spki_start, _s, spki_end = tbs_fields(ca_der)[5]
        spki = ca_der[spki_start:spki_end]
    except (ValueError, IndexError) as exc:
        return Verdict("unknown", f"unreadable CA certificate ({exc})")
    return verify(spki, algorithm, tbs, signature)


def verify(spki: bytes, algorithm: bytes, message: bytes, signature: bytes) -> Verdict:
    """Whether ``signature`` (a BIT STRING's bytes) over ``message`` verifies under the
    SubjectPublicKeyInfo ``spki`` with the AlgorithmIdentifier ``algorithm`` (both DER)."""
    try:
        sig_oid, sig_params = _algorithm(algorithm, 0)
        spki_parts = elements(spki, *tlv(spki, 0)[1:])
        if len(spki_parts) != 2 or spki_parts[1][0] != 0x03:
            raise ValueError("not a SubjectPublicKeyInfo")
        key_oid, key_params = _algorithm(spki, 0, spki_parts[0][1])
        key = _bit_string(spki, spki_parts[1])
    except (ValueError, IndexError) as exc:
        return Verdict("unknown", f"unreadable algorithm or public key ({exc})")
    check: Callable[[], Verdict]
    if sig_oid in _RSA_PKCS1:
        if key_oid != _RSA_KEY:
            return Verdict("invalid", "an RSA signature, and the CA's key is not RSA")
        name = _RSA_PKCS1[sig_oid]
        check = lambda: _rsa_pkcs1(key, name, message, signature)  # noqa: E731
    elif sig_oid == _RSA_PSS:
        if key_oid not in (_RSA_KEY, _RSA_PSS):
            return Verdict("invalid", "an RSA-PSS signature, and the CA's key is not RSA")
        if key_oid == _RSA_PSS and key_params not in (None, sig_params):
            return Verdict("unknown", "RSA-PSS key restricted to other parameters")
        check = lambda: _rsa_pss(key, sig_params, message, signature)  # noqa: E731
    elif sig_oid in _ECDSA:
        if key_oid != _EC_KEY:
            return Verdict("invalid", "an ECDSA signature, and the CA's key is not EC")
        named = key_params or b"\x00\x80"  # namedCurve: an OID (explicit parameters: unknown)
        curve = _CURVES.get(named[2:]) if named[0] == 0x06 and named[1] < 0x80 else None
        if curve is None:
            return Verdict("unknown", "ECDSA over a curve other than P-256 and P-384")
        name = _ECDSA[sig_oid]
        check = lambda: _ecdsa(curve, key, name, message, signature)  # noqa: E731
    elif sig_oid == _ED25519:
        if key_oid != _ED25519:
            return Verdict("invalid", "an Ed25519 signature, and the CA's key is not Ed25519")
        check = lambda: _ed25519(key, message, signature)  # noqa: E731
    else:
        return Verdict("unknown", f"signature algorithm {_dotted(sig_oid)}")
    try:
        return check()
    except (ValueError, IndexError, OverflowError) as exc:  # a key it cannot read: no guess
        return Verdict("unknown", f"unreadable public key ({exc})")


def _dotted(oid: bytes) -> str:
    """An OID's dotted form, for messages."""
    arcs, value = [], 0
    for byte in oid:
        value = value << 7 | byte & 0x7F
        if not byte & 0x80:
            arcs.append(value)
            value = 0
    if not arcs:
        return "?"
    first = min(arcs[0] // 40, 2)
    return ".".join(str(a) for a in [first, arcs[0] - 40 * first, *arcs[1:]])


def _algorithm(der: bytes, pos: int, at: int | None = None) -> tuple[bytes, bytes | None]:
    """(OID contents, parameters' DER or None) of the AlgorithmIdentifier at ``at`` (else
    ``pos``); an explicit NULL counts as no parameters."""
    tag, start, end = tlv(der, pos if at is None else at)
    parts = elements(der, start, end)
    if tag != 0x30 or not parts or parts[0][0] != 0x06 or len(parts) > 2:
        raise ValueError("not an AlgorithmIdentifier")
    oid = der[parts[0][2] : parts[0][3]]
    if len(parts) == 1 or parts[1][0] == 0x05:
        return oid, None
    return oid, der[parts[1][1] : parts[1][3]]


def _bit_string(der: bytes, part: tuple[int, int, int, int]) -> bytes:
    tag, _p, start, end = part
    if tag != 0x03 or start >= end or der[start] != 0:
        raise ValueError("not a whole-byte BIT STRING")
    return der[start + 1 : end]


def _integers(der: bytes, count: int) -> list[int]:
    """The ``count`` non-negative INTEGERs of a DER SEQUENCE that is the whole of ``der``."""
    _t, start, end = tlv(der, 0)
    if der[0] != 0x30 or end != len(der):
        raise ValueError("not a SEQUENCE")
    parts = elements(der, start, end)
    if len(parts) != count or any(p[0] != 0x02 or p[2] == p[3] for p in parts):
        raise ValueError(f"not a SEQUENCE of {count} INTEGERs")
    if any(e - s > 1 and der[s] == 0 and der[s + 1] < 0x80 for _t, _p, s, e in parts):
        raise ValueError("an INTEGER not in its shortest form")  # OpenSSL wants strict DER
    values = [int.from_bytes(der[s:e], "big", signed=True) for _t, _p, s, e in parts]
    if any(v < 0 for v in values):
        raise ValueError("a negative INTEGER")
    return values


def _verdict(ok: bool, algorithm: str) -> Verdict:
    return Verdict("valid" if ok else "invalid", algorithm)


# ---- RSA (RFC 8017) ----------------------------------------------------------------------------


def _rsa_open(key: bytes, signature: bytes) -> tuple[int, int] | None:
    """(the signature's representative raised to e mod n, modulus bits) per RSAVP1; None when
    the signature is out of range. ``ValueError`` for a key that is not an RSAPublicKey."""
    n, e = _integers(key, 2)
    if n < 3 or e < 3:
        raise ValueError("not an RSA public key")
    k = (n.bit_length() + 7) // 8
    s = int.from_bytes(signature, "big")
    if len(signature) > k or s >= n:
        return None
    return pow(s, e, n), n.bit_length()


def _der(tag: int, body: bytes) -> bytes:
    assert len(body) < 0x80  # DigestInfo parts only
    return bytes([tag, len(body)]) + body


def _rsa_pkcs1(key: bytes, hash_name: str, message: bytes, signature: bytes) -> Verdict:
    """RSASSA-PKCS1-v1_5-VERIFY (§8.2.2): EM must equal 00 01 FF..FF 00 DigestInfo."""
    label = f"RSA PKCS#1 v1.5 with {hash_name.upper()}"
    opened = _rsa_open(key, signature)
    if opened is None:
        return _verdict(False, label)
    m, bits = opened
    k = (bits + 7) // 8
    digest = _der(0x04, hashlib.new(hash_name, message).digest())
    oid = _der(0x06, _HASH_OID[hash_name])
    with_null = _der(0x30, _der(0x30, oid + b"\x05\x00") + digest)
    without = _der(0x30, _der(0x30, oid) + digest)  # parameters left out
    for info in (with_null, without):
        pad = k - len(info) - 3
        if pad >= 8 and m.to_bytes(k, "big") == b"\x00\x01" + b"\xff" * pad + b"\x00" + info:
            if info is without:  # whether OpenSSL takes this form is not ours to guess
                return Verdict("unknown", label + " (DigestInfo without NULL parameters)")
            return _verdict(True, label)
    return _verdict(False, label)


def _mgf1(hash_name: str, seed: bytes, length: int) -> bytes:
    out = b""
    counter = 0
    while len(out) < length:
        out += hashlib.new(hash_name, seed + counter.to_bytes(4, "big")).digest()
        counter += 1
    return out[:length]


def _pss_params(params: bytes | None) -> tuple[str, str, int] | None:
    """(hash, MGF1 hash, salt length) of RSASSA-PSS-params (§A.2.3; defaults SHA-1, MGF1 with
    SHA-1, 20), or None for what this module does not verify."""
    hash_name, mgf_hash, salt = "sha1", "sha1", 20
    if params is None:
        return hash_name, mgf_hash, salt
    _t, start, end = tlv(params, 0)
    for tag, _p, vs, _ve in elements(params, start, end):
        if tag == 0xA0:
            oid, _params = _algorithm(params, vs)
            if oid not in _HASHES:
                return None
            hash_name = _HASHES[oid]
        elif tag == 0xA1:
            oid, inner = _algorithm(params, vs)
            if oid != _MGF1 or inner is None:
                return None
            inner_oid, _params = _algorithm(inner, 0)
            if inner_oid not in _HASHES:
                return None
            mgf_hash = _HASHES[inner_oid]
        elif tag in (0xA2, 0xA3):
            itag, s, e = tlv(params, vs)
            if itag != 0x02:
                raise ValueError("PSS parameter is not an INTEGER")
            value = int.from_bytes(params[s:e], "big", signed=True)
            if tag == 0xA2:
                salt = value
            elif value != 1:
                return None  # trailerField other than 0xbc
        else:
            return None
    return (hash_name, mgf_hash, salt) if salt >= 0 else None


def _rsa_pss(key: bytes, params: bytes | None, message: bytes, signature: bytes) -> Verdict:
    """RSASSA-PSS-VERIFY (§8.1.2) with EMSA-PSS-VERIFY (§9.1.2), the salt length as given."""
    try:
        parsed = _pss_params(params)
    except (ValueError, IndexError):
        return Verdict("invalid", "RSA-PSS with unreadable parameters")
    if parsed is None:
        return Verdict("unknown", "RSA-PSS with parameters other than MGF1 and SHA-1/2")
    hash_name, mgf_hash, salt_len = parsed
    label = f"RSA-PSS with {hash_name.upper()}"
    opened = _rsa_open(key, signature)
    if opened is None:
        return _verdict(False, label)
    m, bits = opened
    em_bits = bits - 1
    em_len = (em_bits + 7) // 8
    h_len = hashlib.new(hash_name).digest_size
    if m >> (8 * em_len) or em_len < h_len + salt_len + 2:
        return _verdict(False, label)
    em = m.to_bytes(em_len, "big")
    if em[-1] != 0xBC:
        return _verdict(False, label)
    masked, h = em[: em_len - h_len - 1], em[em_len - h_len - 1 : -1]
    spare = 8 * em_len - em_bits  # leftmost bits of maskedDB that must be zero
    if spare and masked[0] >> (8 - spare):
        return _verdict(False, label)
    db = bytearray(a ^ b for a, b in zip(masked, _mgf1(mgf_hash, h, len(masked)), strict=True))
    db[0] &= 0xFF >> spare
    zeros = em_len - h_len - salt_len - 2
    if any(db[:zeros]) or db[zeros] != 0x01:
        return _verdict(False, label)
    salt = bytes(db[len(db) - salt_len :]) if salt_len else b""
    m_hash = hashlib.new(hash_name, message).digest()
    return _verdict(hashlib.new(hash_name, bytes(8) + m_hash + salt).digest() == h, label)


# ---- ECDSA (FIPS 186-4 §6.4, SEC 1 §4.1.4) -----------------------------------------------------

_Jacobian = tuple[int, int, int]  # (X, Y, Z): x = X/Z², y = Y/Z³; Z = 0 is the point at infinity


def _double(c: _Curve, pt: _Jacobian) -> _Jacobian:
    x, y, z = pt
    if z == 0 or y == 0:
        return (1, 1, 0)
    p = c.p
    yy = y * y % p
    s = 4 * x * yy % p
    zz = z * z % p
    m = (3 * x * x + c.a * zz * zz) % p
    x3 = (m * m - 2 * s) % p
    return x3, (m * (s - x3) - 8 * yy * yy) % p, 2 * y * z % p


def _add(c: _Curve, p1: _Jacobian, p2: _Jacobian) -> _Jacobian:
    x1, y1, z1 = p1
    x2, y2, z2 = p2
    if z1 == 0:
        return p2
    if z2 == 0:
        return p1
    p = c.p
    z1z1, z2z2 = z1 * z1 % p, z2 * z2 % p
    u1, u2 = x1 * z2z2 % p, x2 * z1z1 % p
    s1, s2 = y1 * z2 * z2z2 % p, y2 * z1 * z1z1 % p
    if u1 == u2:
        return _double(c, p1) if s1 == s2 else (1, 1, 0)
    h, r = (u2 - u1) % p, (s2 - s1) % p
    hh = h * h % p
    hhh = h * hh % p
    x3 = (r * r - hhh - 2 * u1 * hh) % p
    return x3, (r * (u1 * hh - x3) - s1 * hhh) % p, h * z1 * z2 % p


def _ec_point(c: _Curve, key: bytes) -> tuple[int, int]:
    """The public point of an ECPoint octet string (SEC 1 §2.3.4), checked to be on the curve."""
    size = (c.p.bit_length() + 7) // 8
    if len(key) == 1 + 2 * size and key[0] == 4:
        x, y = int.from_bytes(key[1 : 1 + size], "big"), int.from_bytes(key[1 + size :], "big")
    elif len(key) == 1 + size and key[0] in (2, 3):
        x = int.from_bytes(key[1:], "big")
        rhs = (x * x * x + c.a * x + c.b) % c.p
        y = pow(rhs, (c.p + 1) // 4, c.p)  # p ≡ 3 (mod 4) for both curves
        if y * y % c.p != rhs:
            raise ValueError("compressed point not on the curve")
        if y & 1 != key[0] & 1:
            y = c.p - y
    else:
        raise ValueError("not an EC point of the key's curve")
    if not (x < c.p and y < c.p and (y * y - x * x * x - c.a * x - c.b) % c.p == 0):
        raise ValueError("public point not on the curve")
    return x, y


def _ecdsa(c: _Curve, key: bytes, hash_name: str, message: bytes, signature: bytes) -> Verdict:
    label = f"ECDSA {c.name} with {hash_name.upper()}"
    qx, qy = _ec_point(c, key)
    try:
        r, s = _integers(signature, 2)
    except (ValueError, IndexError):
        return _verdict(False, label)
    n = c.n
    if not (0 < r < n and 0 < s < n):
        return _verdict(False, label)
    digest = hashlib.new(hash_name, message).digest()
    e = int.from_bytes(digest, "big") >> max(0, 8 * len(digest) - n.bit_length())
    w = pow(s, -1, n)
    u1, u2 = e * w % n, r * w % n
    g, q = (c.gx, c.gy, 1), (qx, qy, 1)
    both = _add(c, g, q)
    acc: _Jacobian = (1, 1, 0)
    for i in range(max(u1.bit_length(), u2.bit_length()) - 1, -1, -1):  # Shamir's trick
        acc = _double(c, acc)
        bit1, bit2 = u1 >> i & 1, u2 >> i & 1
        if bit1 or bit2:
            acc = _add(c, acc, both if bit1 and bit2 else g if bit1 else q)
    x, _y, z = acc
    if z == 0:
        return _verdict(False, label)
    return _verdict(x * pow(z * z, -1, c.p) % c.p % n == r, label)


# ---- Ed25519 (RFC 8032 §5.1) -------------------------------------------------------------------

_ED_P = 2**255 - 19
_ED_L = 2**252 + 27742317777372353535851937790883648493
_ED_D = -121665 * pow(121666, -1, _ED_P) % _ED_P
_ED_SQRT_M1 = pow(2, (_ED_P - 1) // 4, _ED_P)
_Extended = tuple[int, int, int, int]  # (X, Y, Z, T): x = X/Z, y = Y/Z, xy = T/Z


def _ed_add(p1: _Extended, p2: _Extended) -> _Extended:
    """Point addition in extended coordinates (§5.1.4), complete on the curve."""
    p = _ED_P
    a = (p1[1] - p1[0]) * (p2[1] - p2[0]) % p
    b = (p1[1] + p1[0]) * (p2[1] + p2[0]) % p
    c = 2 * p1[3] * p2[3] * _ED_D % p
    d = 2 * p1[2] * p2[2] % p
    e, f, g, h = b - a, d - c, d + c, b + a
    return e * f % p, g * h % p, f * g % p, e * h % p


def _ed_mul(k: int, pt: _Extended) -> _Extended:
    acc: _Extended = (0, 1, 1, 0)
    while k:
        if k & 1:
            acc = _ed_add(acc, pt)
        pt = _ed_add(pt, pt)
        k >>= 1
    return acc


def _ed_decode(b: bytes) -> _Extended:
    """A point from its 32-byte encoding (§5.1.3); ``ValueError`` when it is none."""
    y = int.from_bytes(b, "little")
    sign, y = y >> 255, y & ((1 << 255) - 1)
    if y >= _ED_P:
        raise ValueError("non-canonical y")
    u, v = (y * y - 1) % _ED_P, (_ED_D * y * y + 1) % _ED_P
    x = u * pow(v, 3, _ED_P) * pow(u * pow(v, 7, _ED_P), (_ED_P - 5) // 8, _ED_P) % _ED_P
    if (v * x * x - u) % _ED_P:
        x = x * _ED_SQRT_M1 % _ED_P
        if (v * x * x - u) % _ED_P:
            raise ValueError("not a point")
    if x == 0 and sign:
        raise ValueError("negative zero x")
    if x & 1 != sign:
        x = _ED_P - x
    return x, y, 1, x * y % _ED_P


def _ed_encode(pt: _Extended) -> bytes:
    zi = pow(pt[2], -1, _ED_P)
    x, y = pt[0] * zi % _ED_P, pt[1] * zi % _ED_P
    return (y | (x & 1) << 255).to_bytes(32, "little")


_ED_B = _ed_decode((4 * pow(5, -1, _ED_P) % _ED_P).to_bytes(32, "little"))


def _ed25519(key: bytes, message: bytes, signature: bytes) -> Verdict:
    """Verify (§5.1.7) in the form R = [S]B - [k]A, compared by encoding."""
    label = "Ed25519"
    if len(key) != 32:
        raise ValueError("not an Ed25519 public key")
    a = _ed_decode(key)
    if len(signature) != 64:
        return _verdict(False, label)
    r_bytes, s = signature[:32], int.from_bytes(signature[32:], "little")
    if s >= _ED_L:
        return _verdict(False, label)
    k = int.from_bytes(hashlib.sha512(r_bytes + key + message).digest(), "little") % _ED_L
    minus_a = ((_ED_P - a[0]) % _ED_P, a[1], a[2], (_ED_P - a[3]) % _ED_P)
    return _verdict(_ed_encode(_ed_add(_ed_mul(s, _ED_B), _ed_mul(k, minus_a))) == r_bytes, label)
