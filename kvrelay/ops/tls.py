"""TLS / mTLS contexts for the gRPC listener (and for test clients).

gRPC is HTTP/2, so both sides advertise ALPN ``h2`` (grpcio refuses a TLS peer without it) and
TLS 1.2 is the floor (HTTP/2 forbids older versions). With a client CA the server demands a
client certificate signed by it (mTLS); without one any client that trusts the server may talk.

Certificate rotation (``ReloadableServerContext``): each handshake is run with the newest
*fully loaded* context (``in_use``, which the server's TLS gate asks for at every accepted
connection: ``service/h2/tls_gate.py``). A reload builds a new context from one read of the
files and swaps it in only when it loaded; a file rotated halfway through a reload can then
never leave the listener with a certificate and a key that do not match. No servername callback
is installed: CPython printed a traceback to stderr for every ClientHello whose server name is
not ASCII, which any stranger could send.
"""

from __future__ import annotations

import calendar
import contextlib
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ALPN_H2 = "h2"
H2_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


class TlsConfigError(ValueError):
    """A certificate, key or CA file is missing or unusable."""


def _context(protocol: int) -> ssl.SSLContext:
    """Fresh context with no trusted CAs: each side trusts only the files it is given."""
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols([ALPN_H2])
    ctx.set_ciphers(H2_TLS12_CIPHERS)  # TLS 1.2: forward-secret AEAD only (RFC 9113 §9.2.2)
    ctx.options |= ssl.OP_NO_COMPRESSION
    return ctx


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise TlsConfigError(f"cannot read {path!r}: {exc}") from exc


def _load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str | None) -> bytes:
    """Load the chain and key from *one* read of each file (returns the chain's bytes): OpenSSL
    only takes paths, so the bytes read are handed over through anonymous memory files."""
    cert = _read(cert_file)
    key = _read(key_file) if key_file is not None else None
    try:
        with _memory_file(cert) as cert_path, _memory_file(key) as key_path:
            ctx.load_cert_chain(cert_path, key_path if key is not None else None)
    except (OSError, ssl.SSLError) as exc:
        msg = f"cannot load certificate {cert_file!r} / key {key_file!r}: {exc}"
        raise TlsConfigError(msg) from exc
    return cert


@contextlib.contextmanager
def _memory_file(data: bytes | None) -> Iterator[str]:
    """A path that reads as ``data``: a memfd on Linux, else a private temporary file."""
    if data is None:
        yield ""
        return
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("kvrelay-tls", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.NamedTemporaryFile(prefix="kvrelay-tls-") as f:  # mode 0600
        f.write(data)
        f.flush()
        yield f.name


def _load_ca(ctx: ssl.SSLContext, ca_file: str) -> bytes:
    data = _read(ca_file)
    try:
        ctx.load_verify_locations(cadata=data.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load CA bundle {ca_file!r}: {exc}") from exc
    return data


def server_ssl_context(
    cert_file: str, key_file: str, client_ca_file: str | None
) -> ssl.SSLContext:
    """Server side: TLS 1.2+, ALPN h2; ``client_ca_file`` turns on mandatory client certs."""
    return _server_context(cert_file, key_file, client_ca_file)[0]


def _server_context(
    cert_file: str, key_file: str, client_ca_file: str | None
) -> tuple[ssl.SSLContext, tuple[LoadedCertificate, ...]]:
    """The context and the certificates it holds, from one read of each file."""
    # Not create_default_context(CLIENT_AUTH): it would trust the system CAs for client certs; a
    # relay must trust only the configured client CA.
    ctx = _context(ssl.PROTOCOL_TLS_SERVER)
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    if hasattr(ssl, "OP_NO_RENEGOTIATION"):
        ctx.options |= ssl.OP_NO_RENEGOTIATION
    chain = _load_chain(ctx, cert_file, key_file)
    certs = [_leaf(chain, cert_file, "server")]
    if client_ca_file is not None:
        ca = _load_ca(ctx, client_ca_file)
        certs += _bundle(ca, client_ca_file, "client_ca")
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx, tuple(certs)


@dataclass(frozen=True, slots=True)
class LoadedCertificate:
    """One certificate a context was loaded with, for the expiry gauge."""

    role: str  # "server", "client_ca", "upstream_client", "upstream_ca"
    subject: str  # its common name ("" when it has none)
    not_after_unix: float


class ReloadableServerContext:
    """The listener's context and the newest one loaded from the files (see the module doc)."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None) -> None:
        self.current, self.certificates = _server_context(cert_file, key_file, client_ca_file)

    def in_use(self) -> ssl.SSLContext:
        """The context a new handshake is run with (a server's ``ssl=`` source)."""
        return self.current

    def reload(self, cert_file: str, key_file: str, client_ca_file: str | None) -> None:
        """Load the files once into a new context and use it for new handshakes; raises
        ``TlsConfigError`` (the running context stays) when they do not load."""
        self.stage(cert_file, key_file, client_ca_file)()

    def stage(
        self, cert_file: str, key_file: str, client_ca_file: str | None
    ) -> Callable[[], None]:
        """Load the files into a new context now (``TlsConfigError`` when they do not load) and
        return what puts it in use, so a reload changes nothing until all its steps have passed."""
        loaded = _server_context(cert_file, key_file, client_ca_file)

        def use() -> None:
            self.current, self.certificates = loaded

        return use


def client_certificates(ca_file: str, cert_file: str | None) -> tuple[LoadedCertificate, ...]:
    """A client's CA bundle and its own certificate (mTLS), with their expiry."""
    out = _bundle(_read(ca_file), ca_file, "upstream_ca")
    if cert_file is not None:
        out.append(_leaf(_read(cert_file), cert_file, "upstream_client"))
    return tuple(out)


def _leaf(pem: bytes, path: str, role: str) -> LoadedCertificate:
    blocks = _pem_blocks(pem)
    if not blocks:
        raise TlsConfigError(f"{path!r}: no PEM certificate in it")
    return _describe(blocks[0], role, path)


def _bundle(pem: bytes, path: str, role: str) -> list[LoadedCertificate]:
    return [_describe(block, role, path) for block in _pem_blocks(pem)]


_BEGIN, _END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"


def _pem_blocks(data: bytes) -> list[str]:
    text = data.decode("ascii", "replace")
    out = []
    pos = 0
    while (start := text.find(_BEGIN, pos)) >= 0:
        end = text.find(_END, start)
        if end < 0:
            break
        out.append(text[start : end + len(_END)] + "\n")
        pos = end + len(_END)
    return out


def _describe(pem: str, role: str, path: str) -> LoadedCertificate:
    try:
        der = ssl.PEM_cert_to_DER_cert(pem)
        subject, not_after = _subject_and_not_after(der)
    except (ValueError, IndexError) as exc:
        raise TlsConfigError(f"{path!r}: not a readable X.509 certificate ({exc})") from exc
    return LoadedCertificate(role, subject, not_after)


def _tlv(buf: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, value start, value end) of the DER element at ``pos``."""
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


_CN_OID = bytes.fromhex("550403")  # 2.5.4.3


def _subject_and_not_after(der: bytes) -> tuple[str, float]:
    """The subject CN and ``notAfter`` (Unix time) of a DER X.509 certificate (RFC 5280 §4.1:
    tbsCertificate = [0] version, serial, signature, issuer, validity, subject, ...)."""
    _t, cert, _e = _tlv(der, 0)
    tag, pos, end = _tlv(der, cert)  # tbsCertificate
    fields: list[tuple[int, int, int]] = []
    while pos < end and len(fields) < 6:
        tag, start, stop = _tlv(der, pos)
        if tag != 0xA0:  # the optional explicit version
            fields.append((tag, start, stop))
        pos = stop
    if len(fields) < 5:
        raise ValueError("short tbsCertificate")
    _t, vstart, _vend = fields[3]
    _t, _s1, e1 = _tlv(der, vstart)  # notBefore
    ttag, s2, e2 = _tlv(der, e1)  # notAfter
    text = der[s2:e2].decode("ascii")
    if ttag == 0x17:  # UTCTime YYMMDDHHMMSSZ (RFC 5280: 50..99 → 19xx)
        yy = int(text[:2])
        text = ("19" if yy >= 50 else "20") + text
    elif ttag != 0x18:  # GeneralizedTime YYYYMMDDHHMMSSZ
        raise ValueError("bad validity time")
    y, mo, d, h, mi, sec = (int(text[i : i + w]) for i, w in
                            ((0, 4), (4, 2), (6, 2), (8, 2), (10, 2), (12, 2)))  # fmt: skip
    not_after = float(calendar.timegm((y, mo, d, h, mi, sec, 0, 0, 0)))
    subject = ""
    _t, sstart, send = fields[4]  # subject Name: SET of SEQUENCE {oid, value}
    pos = sstart
    while pos < send:
        _t, rs, re_ = _tlv(der, pos)
        inner = rs
        while inner < re_:
            _t, as_, ae = _tlv(der, inner)
            _t, os_, oe = _tlv(der, as_)
            if der[os_:oe] == _CN_OID:
                _t, vs, ve = _tlv(der, oe)
                subject = der[vs:ve].decode("utf-8", "replace")
            inner = ae
        pos = re_
    return subject, not_after


def client_ssl_context(
    ca_file: str, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """Client side: verifies the server against ``ca_file`` (hostname checked); optional client
    certificate for mTLS."""
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED + hostname check by default
    _load_ca(ctx, ca_file)
    if cert_file is not None:
        _load_chain(ctx, cert_file, key_file)
    elif key_file is not None:
        raise TlsConfigError("key_file given without cert_file")
    return ctx


def is_loopback(host: str) -> bool:
    """True only for addresses that cannot leave the machine (no DNS lookups: unknown → False).

    ``""``, ``0.0.0.0`` and ``::`` bind every interface, so they are not loopback. Used to refuse
    (or warn about) plaintext listeners reachable from the network.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if not h:
        return False
    lowered = h.lower().rstrip(".")
    if lowered == "localhost" or lowered.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback
