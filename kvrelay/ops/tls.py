"""TLS / mTLS contexts for the gRPC listener (and for test clients).

gRPC is HTTP/2, so both sides advertise ALPN ``h2`` (grpcio refuses a TLS peer without it) and
TLS 1.2 is the floor (HTTP/2 forbids older versions). With a client CA the server demands a
client certificate signed by it (mTLS); without one any client that trusts the server may talk.
"""

from __future__ import annotations

import ipaddress
import ssl

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


def _load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str | None) -> None:
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        msg = f"cannot load certificate {cert_file!r} / key {key_file!r}: {exc}"
        raise TlsConfigError(msg) from exc


def _load_ca(ctx: ssl.SSLContext, ca_file: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load CA bundle {ca_file!r}: {exc}") from exc


def server_ssl_context(
    cert_file: str, key_file: str, client_ca_file: str | None
) -> ssl.SSLContext:
    """Server side: TLS 1.2+, ALPN h2; ``client_ca_file`` turns on mandatory client certs."""
    # Not create_default_context(CLIENT_AUTH): it would trust the system CAs for client certs; a
    # relay must trust only the configured client CA.
    ctx = _context(ssl.PROTOCOL_TLS_SERVER)
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    if hasattr(ssl, "OP_NO_RENEGOTIATION"):
        ctx.options |= ssl.OP_NO_RENEGOTIATION
    _load_chain(ctx, cert_file, key_file)
    if client_ca_file is not None:
        _load_ca(ctx, client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


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
