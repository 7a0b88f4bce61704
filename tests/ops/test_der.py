"""``der.name_key``: X.509 names compared as OpenSSL compares them (RFC 5280 §7.1), from DER
built here byte by byte: one name in any string type, case or spacing is one key; other names
never are; a value that does not decode in its string type is compared as its bytes, never an
error (an error made a revoked certificate's open connection read as not revoked)."""

from __future__ import annotations

from kvrelay.ops.der import name_key

CN = b"\x06\x03\x55\x04\x03"  # OID 2.5.4.3
ORG = b"\x06\x03\x55\x04\x0a"  # OID 2.5.4.10


def _tlv(tag: int, body: bytes) -> bytes:
    assert len(body) < 128
    return bytes([tag, len(body)]) + body


def _name(*rdns: list[tuple[bytes, int, bytes]]) -> bytes:
    """A Name's value (its SEQUENCE's contents): RDNs of (oid, string tag, value bytes)."""
    return b"".join(
        _tlv(0x31, b"".join(_tlv(0x30, oid + _tlv(tag, v)) for oid, tag, v in rdn))
        for rdn in rdns
    )


def key(*rdns: list[tuple[bytes, int, bytes]]) -> object:
    der = _name(*rdns)
    return name_key(der, 0, len(der))


UTF8, PRINTABLE, T61, IA5, BMP, UNIVERSAL = 0x0C, 0x13, 0x14, 0x16, 0x1E, 0x1C


def test_one_name_in_any_string_type_case_or_spacing_is_one_key() -> None:
    base = key([(CN, UTF8, b"Client CA")])
    assert key([(CN, PRINTABLE, b"CLIENT CA")]) == base
    assert key([(CN, T61, b"client  ca ")]) == base
    assert key([(CN, IA5, b" client\tca")]) == base
    assert key([(CN, BMP, "client ca".encode("utf-16-be"))]) == base
    assert key([(CN, UNIVERSAL, "Client CA".encode("utf-32-be"))]) == base
    # the attributes of one RDN in either order
    one_rdn = key([(CN, UTF8, b"a"), (ORG, UTF8, b"b")])
    assert one_rdn == key([(ORG, PRINTABLE, b"B"), (CN, UTF8, b"A")])


def test_other_names_are_other_keys() -> None:
    base = key([(CN, UTF8, b"a")])
    for other in (
        key([(CN, UTF8, b"a b")]),
        key([(ORG, UTF8, b"a")]),
        key([(CN, UTF8, b"a")], [(ORG, UTF8, b"x")]),
        key([(CN, UTF8, "\u00e9".encode())]),  # é: only ASCII letters fold
        key([(CN, UTF8, "\u212a".encode())]),  # the Kelvin sign is no K
    ):
        assert other != base
    assert key([(CN, UTF8, "\u00c9".encode())]) != key([(CN, UTF8, "\u00e9".encode())])
    two_rdns = key([(CN, UTF8, b"a")], [(ORG, UTF8, b"b")])
    assert two_rdns != key([(ORG, UTF8, b"b")], [(CN, UTF8, b"a")])
    assert key([(CN, UTF8, b"a"), (ORG, UTF8, b"b")]) != two_rdns


def test_a_value_that_does_not_decode_is_compared_as_its_bytes() -> None:
    assert key([(CN, PRINTABLE, b"caf\xe9")]) == key([(CN, UTF8, "café".encode())])
    bad = key([(CN, UTF8, b"\xff")])  # not UTF-8: its bytes, equal only to itself
    assert bad == key([(CN, UTF8, b"\xff")]) and bad != key([(CN, UTF8, b"\xc3\xbf")])
    assert key([(CN, BMP, b"\x00a\x00")]) != key([(CN, UTF8, b"a")])  # odd length
