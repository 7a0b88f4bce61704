"""TLS / mTLS contexts for the gRPC listener, a mirror's upstream channel (and test clients).

gRPC is HTTP/2, so both sides advertise ALPN ``h2`` (grpcio refuses a TLS peer without it) and
TLS 1.2 is the floor (HTTP/2 forbids older versions). With a client CA the server demands a
client certificate signed by it (mTLS); without one any client that trusts the server may talk.

Certificate rotation (``ReloadableServerContext``): each handshake is run with the newest
*fully loaded* context (``in_use``, which the server's TLS gate asks for at every accepted
connection: ``service/h2/tls_gate.py``). A reload builds a new context from one read of the
files and swaps it in only when it loaded; a file rotated halfway through a reload can then
never leave the listener with a certificate and a key that do not match. No servername callback
is installed: CPython printed a traceback to stderr for every ClientHello whose server name is
not ASCII, which any stranger could send. A mirror's upstream context rotates the same way
(``ReloadableClientContext``): the mirror asks ``in_use`` each time it opens an upstream channel,
so the connection it holds keeps its handshake and the next one presents the reloaded files.

Revocation (``client_crl``): the CRLs are loaded into the context beside the client CA, with
``VERIFY_CRL_CHECK_LEAF``: OpenSSL refuses a client whose certificate its issuer's CRL lists,
and one whose issuer has no CRL loaded, or only an expired one (it fails closed). Only the leaf
is checked: with ``CHAIN`` every CA up to the root would need a CRL of its own, and a missing
one would lock every client out; an intermediate is withdrawn by removing it from the CA bundle.
The serials each CRL revokes are kept too (``revoked``), for the connections a new CRL must end:
OpenSSL checks a certificate only at its handshake. OpenSSL picks a CRL's CA by name alone, so a
CRL that names a CA of the bundle but that none of that name signed (another key under the same
subject) would fail every client of that CA; it is refused when loaded (``crl_signature``),
checked on the very bytes loaded, so a start, a reload and each worker refuse it alike.
"""

from __future__ import annotations

import base64
import calendar
import contextlib
import ipaddress
import os
import ssl
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvrelay.ops.crl_signature import Verdict, verify_crl
from kvrelay.ops.der import NameKey, name_key
from kvrelay.ops.der import elements as _elements
from kvrelay.ops.der import tbs_fields as _tbs_fields
from kvrelay.ops.der import tlv as _tlv

ALPN_H2 = "h2"
H2_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


class TlsConfigError(ValueError):
    """A certificate, key or CA file is missing or unusable."""


class CrlSignatureError(TlsConfigError):
    """A client CRL names a client CA as its issuer and no CA of that name signed it: OpenSSL
    would refuse every client of that CA ("CRL signature failure")."""


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


def _load_crl(ctx: ssl.SSLContext, crl_file: str) -> tuple[RevocationList, ...]:
    """The CRLs of ``crl_file`` into the context (``load_verify_locations`` takes CRLs only from
    a file, so from a memory file of the one read), checked at each handshake's leaf."""
    data = _read(crl_file)
    crls = read_crls(data, crl_file)
    try:
        with _memory_file(data) as path:
            ctx.load_verify_locations(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load CRL file {crl_file!r}: {exc}") from exc
    ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return crls


def _load_ca(ctx: ssl.SSLContext, ca_file: str) -> bytes:
    data = _read(ca_file)
    try:
        ctx.load_verify_locations(cadata=data.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load CA bundle {ca_file!r}: {exc}") from exc
    return data


def server_ssl_context(
    cert_file: str, key_file: str, client_ca_file: str | None, client_crl_file: str | None = None
) -> ssl.SSLContext:
    """Server side: TLS 1.2+, ALPN h2; ``client_ca_file`` turns on mandatory client certs,
    ``client_crl_file`` refuses those its CRLs revoke (see the module doc)."""
    return _server_context(cert_file, key_file, client_ca_file, client_crl_file).context


@dataclass(frozen=True, slots=True)
class _Loaded:
    """One load of the TLS files: the context, the certificates (and CRLs) it holds for the
    expiry gauge, and the ``(issuer, serial)`` pairs its CRLs revoke."""

    context: ssl.SSLContext
    certificates: tuple[LoadedCertificate, ...]
    revoked: frozenset[tuple[NameKey, int]]


def _server_context(
    cert_file: str, key_file: str, client_ca_file: str | None, client_crl_file: str | None
) -> _Loaded:
    """The context and what it holds, from one read of each file."""
    # Not create_default_context(CLIENT_AUTH): it would trust the system CAs for client certs; a
    # relay must trust only the configured client CA.
    ctx = _context(ssl.PROTOCOL_TLS_SERVER)
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    if hasattr(ssl, "OP_NO_RENEGOTIATION"):
        ctx.options |= ssl.OP_NO_RENEGOTIATION
    chain = _load_chain(ctx, cert_file, key_file)
    certs = [_leaf(chain, cert_file, "server")]
    revoked: frozenset[tuple[NameKey, int]] = frozenset()
    if client_ca_file is not None:
        ca = _load_ca(ctx, client_ca_file)
        certs += _bundle(ca, client_ca_file, "client_ca")
        ctx.verify_mode = ssl.CERT_REQUIRED
        if client_crl_file is not None:
            crls = _load_crl(ctx, client_crl_file)
            errors, _unknown = crl_signature_problems(crls, ca, client_ca_file)
            if errors:  # checked on the bytes loaded, so a file rotated since check-config too
                raise CrlSignatureError(f"{client_crl_file!r}: " + "; ".join(errors))
            revoked = frozenset((c.issuer, n) for c in crls for n in c.serials)
            certs += [LoadedCertificate("client_crl", c.issuer_cn, c.next_update_unix)
                      for c in crls if c.next_update_unix is not None]  # fmt: skip
    elif client_crl_file is not None:
        raise TlsConfigError("a client CRL needs a client CA (client_ca)")
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return _Loaded(ctx, tuple(certs), revoked)


@dataclass(frozen=True, slots=True)
class LoadedCertificate:
    """One certificate a context was loaded with, for the expiry gauge."""

    role: str  # "server", "client_ca", "client_crl", "upstream_client", "upstream_ca"
    subject: str  # its common name ("" when it has none; a CRL's: its issuer's)
    not_after_unix: float  # a CRL's: its nextUpdate


class _Reloadable:
    """A context in use and the certificates it holds; ``stage`` loads a new one whole from one
    read of each file before anything changes, and its result puts it in use."""

    current: ssl.SSLContext
    certificates: tuple[LoadedCertificate, ...]

    def _use(self, loaded: _Loaded) -> None:
        self.current, self.certificates = loaded.context, loaded.certificates

    def in_use(self) -> ssl.SSLContext:
        """The context a new handshake is run with (read at each one: a reload swaps it)."""
        return self.current


@dataclass(frozen=True, slots=True)
class ServerTlsFiles:
    """A TLS listener's files: its certificate and key, and for mTLS the client CA bundle and
    its CRLs. One value for whatever loads, reloads or hands them on (a fan-out worker gets
    them as JSON, ``as_json``, and reads them back with ``ServerTlsFiles(**json)``)."""

    cert: str
    key: str
    client_ca: str | None = None
    client_crl: str | None = None

    def as_json(self) -> dict[str, str | None]:
        return {"cert": self.cert, "key": self.key, "client_ca": self.client_ca,
                "client_crl": self.client_crl}  # fmt: skip


class ReloadableServerContext(_Reloadable):
    """The listener's context and the newest one loaded from the files (see the module doc)."""

    def __init__(self, files: ServerTlsFiles) -> None:
        self._use(_server_context(files.cert, files.key, files.client_ca, files.client_crl))

    def _use(self, loaded: _Loaded) -> None:
        super()._use(loaded)
        self.revoked = loaded.revoked

    def is_revoked(self, peer_der: bytes) -> bool:
        """Whether the CRLs in use revoke this client certificate (DER): what a reload that
        brought a new CRL asks of each open connection (``ClosingServer.revoke``)."""
        if not self.revoked:
            return False
        try:
            return certificate_issuer_serial(peer_der) in self.revoked
        except (ValueError, IndexError):
            return False  # OpenSSL verified it: not reached

    def reload(self, files: ServerTlsFiles) -> None:
        """Load the files once into a new context and use it for new handshakes; raises
        ``TlsConfigError`` (the running context stays) when they do not load."""
        self.stage(files)()

    def stage(self, files: ServerTlsFiles) -> Callable[[], None]:
        """Load the files into a new context now (``TlsConfigError`` when they do not load) and
        return what puts it in use, so a reload changes nothing until all its steps have passed."""
        loaded = _server_context(files.cert, files.key, files.client_ca, files.client_crl)
        return lambda: self._use(loaded)


class ReloadableClientContext(_Reloadable):
    """A mirror's context towards its upstream: the CA it verifies the upstream against and its
    own client certificate (mTLS). The mirror reads ``in_use`` at each upstream connection it
    makes (its channel's reconnections too), so a reload's files serve its next upstream
    connection while the running one goes on (a client certificate is presented only at a
    handshake)."""

    def __init__(self, ca_file: str, cert_file: str | None, key_file: str | None) -> None:
        self._use(_client_context(ca_file, cert_file, key_file))

    def stage(
        self, ca_file: str, cert_file: str | None, key_file: str | None
    ) -> Callable[[], None]:
        """As ``ReloadableServerContext.stage``: loaded whole now, put in use by the result."""
        loaded = _client_context(ca_file, cert_file, key_file)
        return lambda: self._use(loaded)


def _leaf(pem: bytes, path: str, role: str) -> LoadedCertificate:
    blocks = _pem_blocks(pem)
    if not blocks:
        raise TlsConfigError(f"{path!r}: no PEM certificate in it")
    return _describe(blocks[0], role, path)


def _bundle(pem: bytes, path: str, role: str) -> list[LoadedCertificate]:
    return [_describe(block, role, path) for block in _pem_blocks(pem)]


_BEGIN, _END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
_CRL_BEGIN, _CRL_END = "-----BEGIN X509 CRL-----", "-----END X509 CRL-----"


def _pem_blocks(data: bytes, begin: str = _BEGIN, end_marker: str = _END) -> list[str]:
    text = data.decode("ascii", "replace")
    out = []
    pos = 0
    while (start := text.find(begin, pos)) >= 0:
        end = text.find(end_marker, start)
        if end < 0:
            break
        out.append(text[start : end + len(end_marker)] + "\n")
        pos = end + len(end_marker)
    return out


def _pem_der(block: str, begin: str, end: str) -> bytes:
    body = block.strip()[len(begin) : -len(end)]
    return base64.b64decode("".join(body.split()), validate=True)


def _describe(pem: str, role: str, path: str) -> LoadedCertificate:
    try:
        der = ssl.PEM_cert_to_DER_cert(pem)
        subject, not_after = _subject_and_not_after(der)
    except (ValueError, IndexError) as exc:
        raise TlsConfigError(f"{path!r}: not a readable X.509 certificate ({exc})") from exc
    return LoadedCertificate(role, subject, not_after)


_CN_OID = bytes.fromhex("550403")  # 2.5.4.3


def _time(der: bytes, tag: int, start: int, end: int) -> float:
    """A UTCTime or GeneralizedTime as Unix time."""
    text = der[start:end].decode("ascii")
    if tag == 0x17:  # UTCTime YYMMDDHHMMSSZ (RFC 5280: 50..99 → 19xx)
        yy = int(text[:2])
        text = ("19" if yy >= 50 else "20") + text
    elif tag != 0x18:  # GeneralizedTime YYYYMMDDHHMMSSZ
        raise ValueError("bad validity time")
    y, mo, d, h, mi, sec = (int(text[i : i + w]) for i, w in
                            ((0, 4), (4, 2), (6, 2), (8, 2), (10, 2), (12, 2)))  # fmt: skip
    return float(calendar.timegm((y, mo, d, h, mi, sec, 0, 0, 0)))


def _common_name(der: bytes, start: int, end: int) -> str:
    """The CN of a Name's value (SET of SEQUENCE {oid, value}); "" when it has none."""
    subject = ""
    for _t, _p, rs, re_ in _elements(der, start, end):
        for _t2, _p2, as_, ae in _elements(der, rs, re_):
            _t3, os_, oe = _tlv(der, as_)
            if der[os_:oe] == _CN_OID and oe < ae:
                _t4, vs, ve = _tlv(der, oe)
                subject = der[vs:ve].decode("utf-8", "replace")
    return subject


def _subject_and_not_after(der: bytes) -> tuple[str, float]:
    """The subject CN and ``notAfter`` (Unix time) of a DER X.509 certificate."""
    fields = _tbs_fields(der)
    _t, _p, vstart, _vend = fields[3]
    _t, _s1, e1 = _tlv(der, vstart)  # notBefore
    ttag, s2, e2 = _tlv(der, e1)  # notAfter
    not_after = _time(der, ttag, s2, e2)
    _t, _p, sstart, send = fields[4]
    return _common_name(der, sstart, send), not_after


def certificate_issuer_serial(der: bytes) -> tuple[NameKey, int]:
    """A DER certificate's issuer (as names compare: ``der.name_key``) and serial number: what
    a CRL entry names it by."""
    fields = _tbs_fields(der)
    _t, _p, s, e = fields[0]
    _t, _ip, istart, iend = fields[2]
    return name_key(der, istart, iend), int.from_bytes(der[s:e], "big", signed=True)


def _subject_name(der: bytes) -> NameKey:
    """A DER certificate's subject, as names compare (``der.name_key``)."""
    _t, _p, s, e = _tbs_fields(der)[4]
    return name_key(der, s, e)


@dataclass(frozen=True, slots=True)
class RevocationList:
    """One CRL as the relay reads it: who issued it, when it is due again, what it revokes."""

    issuer: NameKey  # the issuer Name as names compare (a certificate's issuer field's key)
    issuer_cn: str
    this_update_unix: float
    next_update_unix: float | None  # None: the CRL names none (OpenSSL never deems it expired)
    serials: frozenset[int]
    der: bytes = field(default=b"", repr=False, compare=False)  # the whole CRL, for its signature


def read_crls(data: bytes, path: str) -> tuple[RevocationList, ...]:
    """Every PEM CRL (``X509 CRL`` block) in ``data``; ``TlsConfigError`` when there is none or
    one does not parse (RFC 5280 §5.1: tbsCertList = version?, signature, issuer, thisUpdate,
    nextUpdate?, revokedCertificates?, [0] extensions?)."""
    blocks = _pem_blocks(data, _CRL_BEGIN, _CRL_END)
    if not blocks:
        raise TlsConfigError(f"{path!r}: no PEM CRL (BEGIN X509 CRL) in it")
    out = []
    for i, block in enumerate(blocks):
        try:
            der = _pem_der(block, _CRL_BEGIN, _CRL_END)
            _t, body, _e = _tlv(der, 0)
            _t, pos, end = _tlv(der, body)
            fields = _elements(der, pos, end)
            if fields and fields[0][0] == 0x02:  # version (v2)
                fields = fields[1:]
            if len(fields) < 3:
                raise ValueError("short tbsCertList")
            _t, _ip, istart, iend = fields[1]
            issuer = name_key(der, istart, iend)
            ttag, _p, ts, te = fields[2]
            this_update = _time(der, ttag, ts, te)
            rest = fields[3:]
            next_update = None
            if rest and rest[0][0] in (0x17, 0x18):
                ntag, _p, ns, ne = rest[0]
                next_update = _time(der, ntag, ns, ne)
                rest = rest[1:]
            serials = set()
            if rest and rest[0][0] == 0x30:
                _t, _p, rs, re_ = rest[0]
                for _t2, _p2, es, _ee in _elements(der, rs, re_):
                    stag, ss, se = _tlv(der, es)
                    if stag != 0x02:
                        raise ValueError("revoked entry without a serial")
                    serials.add(int.from_bytes(der[ss:se], "big", signed=True))
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            msg = f"{path!r}: CRL {i + 1} is not a readable X.509 CRL ({exc})"
            raise TlsConfigError(msg) from exc
        out.append(RevocationList(issuer, _common_name(der, istart, iend), this_update,
                                  next_update, frozenset(serials), der))  # fmt: skip
    return tuple(out)


def crl_problems(
    crl_file: str, ca_file: str, now: float | None = None
) -> tuple[list[str], list[str]]:
    """What ``check-config`` says of a client CRL file against the client CA bundle: (errors,
    warnings). Errors: a CRL no configured CA issued (OpenSSL would never use it), one past
    its nextUpdate or before its thisUpdate (OpenSSL then refuses *every* client of that CA).
    Errors too: a CRL that names a CA of the bundle as its issuer and that no CA of that name
    signed (OpenSSL refuses every client of that CA: "CRL signature failure").
    Warnings: a CA without a CRL (its clients are refused: no CRL to check them against), a CRL
    whose signature algorithm this relay cannot verify."""
    now = time.time() if now is None else now
    crls = read_crls(_read(crl_file), crl_file)
    ca_pem = _read(ca_file)
    cas: dict[NameKey, str] = {}
    for block in _pem_blocks(ca_pem):
        try:
            der = ssl.PEM_cert_to_DER_cert(block)
            cas[_subject_name(der)] = _subject_and_not_after(der)[0]
        except (ValueError, IndexError) as exc:
            raise TlsConfigError(f"{ca_file!r}: not a readable X.509 certificate ({exc})") from exc
    errors, warnings = crl_signature_problems(crls, ca_pem, ca_file)
    for i, crl in enumerate(crls, 1):
        name = f"CRL {i} (issuer CN {crl.issuer_cn!r})"
        if crl.issuer not in cas:
            errors.append(f"{name} was not issued by any CA in client_ca {ca_file!r}")
        if crl.next_update_unix is not None and crl.next_update_unix < now:
            errors.append(
                f"{name} expired at {_utc(crl.next_update_unix)} (its nextUpdate): every "
                "client of its CA would be refused; publish a fresh CRL"
            )
        if crl.this_update_unix > now:
            errors.append(
                f"{name} is not valid before {_utc(crl.this_update_unix)} (its thisUpdate): "
                "every client of its CA would be refused until then"
            )
    covered = {crl.issuer for crl in crls}
    for subject, cn in cas.items():
        if subject not in covered:
            warnings.append(
                f"no CRL for client CA {cn!r}: every client certificate it issued is refused "
                "(OpenSSL has no CRL to check it against)"
            )
    return errors, warnings


def crl_signature_problems(
    crls: tuple[RevocationList, ...], ca_pem: bytes, ca_file: str
) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the CRLs' signatures against the CAs of the bundle with each one's
    issuer name: an error when none of them signed it, a warning when none verifies and this
    module cannot verify the signature of one (an algorithm it does not know). A CRL whose
    issuer is not in the bundle is left to the issuer check (``crl_problems``)."""
    by_subject: dict[NameKey, list[bytes]] = {}
    for block in _pem_blocks(ca_pem):
        try:
            der = ssl.PEM_cert_to_DER_cert(block)
            by_subject.setdefault(_subject_name(der), []).append(der)
        except (ValueError, IndexError):
            continue  # the bundle's own check names it
    errors, warnings = [], []
    for i, crl in enumerate(crls, 1):
        issuers = by_subject.get(crl.issuer, [])
        if not issuers:
            continue
        verdicts: list[Verdict] = [verify_crl(crl.der, ca) for ca in issuers]
        if any(v.outcome == "valid" for v in verdicts):
            continue
        name = f"CRL {i} (issuer CN {crl.issuer_cn!r})"
        unknown = [v.detail for v in verdicts if v.outcome == "unknown"]
        if unknown:
            warnings.append(
                f"{name}: its signature could not be verified ({unknown[0]}): if no CA of that "
                f"name in client_ca {ca_file!r} signed it, OpenSSL refuses every client of it"
            )
        else:
            errors.append(
                f"{name} is not signed by the key of any CA of that name in client_ca "
                f"{ca_file!r} ({verdicts[0].detail}): OpenSSL would refuse every client of that "
                "CA (CRL signature failure); a CRL of another CA with the same name (re-keyed, "
                "or a staging CA)?"
            )
    return errors, warnings


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def client_ssl_context(
    ca_file: str, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """Client side: verifies the server against ``ca_file`` (hostname checked); optional client
    certificate for mTLS."""
    return _client_context(ca_file, cert_file, key_file).context


def _client_context(ca_file: str, cert_file: str | None, key_file: str | None) -> _Loaded:
    """The client context and the certificates it holds (the CA bundle, the client's own), from
    one read of each file."""
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED + hostname check by default
    certs = _bundle(_load_ca(ctx, ca_file), ca_file, "upstream_ca")
    if cert_file is not None:
        chain = _load_chain(ctx, cert_file, key_file)
        certs.append(_leaf(chain, cert_file, "upstream_client"))
    elif key_file is not None:
        raise TlsConfigError("key_file given without cert_file")
    return _Loaded(ctx, tuple(certs), frozenset())


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
