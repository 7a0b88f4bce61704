"""Test PKI generated at test time with the ``openssl`` CLI (no keys are checked in).

Two independent CAs: one signs the server certificate (SAN ``localhost`` + ``127.0.0.1``), the
other signs client certificates; a third "rogue" CA signs a client the relay must refuse.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


#: ``make_ca``'s key types: ``openssl req`` options for each.
CA_KEYS = {
    "p256": _EC,
    "p384": ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:secp384r1", "-nodes"],
    "secp256k1": ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:secp256k1", "-nodes"],
    "rsa": ["-newkey", "rsa:2048", "-nodes"],
    "ed25519": ["-newkey", "ed25519", "-nodes"],
}


def make_ca(d: Path, name: str, *, key_type: str = "p256") -> tuple[Path, Path]:
    """A self-signed CA with subject ``CN=name`` and a new key of ``key_type`` (``CA_KEYS``)."""
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    _run(
        "req", "-x509", *CA_KEYS[key_type], "-keyout", str(key), "-out", str(crt), "-days", "2",
        "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )
    return crt, key


def make_ca_twin(d: Path, name: str, ca: tuple[Path, Path], cn: str) -> tuple[Path, Path]:
    """``ca``'s key self-signed again under subject ``CN=cn`` as a PrintableString (``ca``'s
    is a UTF8String, OpenSSL's default): one CA name encoded two ways when ``cn`` differs from
    ``ca``'s only in case. What the twin signs (a CRL, a leaf) names ``ca``'s issuer so
    encoded, and OpenSSL takes it for ``ca``'s (RFC 5280 §7.1 name matching)."""
    crt = d / f"{name}.crt"
    conf = d / f"{name}.cnf"
    conf.write_text(
        "[req]\ndistinguished_name = dn\nstring_mask = default\nx509_extensions = ext\n"
        "prompt = no\n[dn]\nCN = x\n[ext]\nbasicConstraints=critical,CA:TRUE\n"
        "keyUsage=critical,keyCertSign,cRLSign\nsubjectKeyIdentifier=hash\n"
    )
    _run("req", "-x509", "-new", "-key", str(ca[1]), "-subj", f"/CN={cn}", "-config", str(conf),
         "-days", "2", "-out", str(crt), cwd=d)  # fmt: skip
    return crt, ca[1]


def make_leaf(
    d: Path,
    name: str,
    ca: tuple[Path, Path],
    *,
    server: bool,
    sans: Sequence[str] = (),
    cn: str | None = None,
) -> tuple[Path, Path]:
    """A leaf certificate; ``sans`` adds client SANs such as ``URI:spiffe://…`` or
    ``DNS:router.team-b``; ``cn`` the subject CN (default ``name``)."""
    crt, key, csr, ext = (d / f"{name}.{s}" for s in ("crt", "key", "csr", "ext"))
    _run("req", "-new", *_EC, "-keyout", str(key), "-out", str(csr),
         "-subj", f"/CN={cn or name}", cwd=d)  # fmt: skip
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        "subjectKeyIdentifier=hash",
        "authorityKeyIdentifier=keyid,issuer",
        "extendedKeyUsage=serverAuth" if server else "extendedKeyUsage=clientAuth",
    ]
    if server:
        lines.append("subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1")
    elif sans:
        lines.append("subjectAltName=" + ",".join(sans))
    ext.write_text("\n".join(lines) + "\n")
    _run(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
        "-set_serial", str(secrets.randbits(63)), "-days", "2", "-sha256",
        "-extfile", str(ext), "-out", str(crt),
        cwd=d,
    )
    return crt, key


def make_dated_leaf(
    d: Path, name: str, ca: tuple[Path, Path], not_before: str, not_after: str
) -> tuple[Path, Path]:
    """A client certificate valid from ``not_before`` to ``not_after`` (``YYYYMMDDHHMMSSZ``, to
    the second: ``openssl ca``, since ``openssl x509`` of OpenSSL 3.0 sets whole days only)."""
    work = d / f"{name}.ca"
    work.mkdir()
    (work / "index.txt").write_text("")
    (work / "serial").write_text(f"{secrets.randbits(62):X}".rjust(16, "0") + "\n")
    conf = work / "ca.cnf"
    conf.write_text(
        "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\nnew_certs_dir = .\n"
        "serial = serial\ndefault_md = sha256\npolicy = p\nunique_subject = no\n"
        "x509_extensions = ext\n[p]\ncommonName = supplied\n[ext]\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
    )
    crt, key, csr = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr"
    _run("req", "-new", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}",
         cwd=d)  # fmt: skip
    _run("ca", "-batch", "-notext", "-config", str(conf.resolve()), "-cert", str(ca[0].resolve()),
         "-keyfile", str(ca[1].resolve()), "-in", str(csr.resolve()), "-out", str(crt.resolve()),
         "-startdate", not_before, "-enddate", not_after, cwd=work)  # fmt: skip
    return crt, key


@dataclass(frozen=True)
class Pki:
    server_ca: Path
    server_cert: Path
    server_key: Path
    client_ca: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path


def make_pki(d: Path) -> Pki:
    sca = make_ca(d, "server-ca")
    cca = make_ca(d, "client-ca")
    rca = make_ca(d, "rogue-ca")
    srv = make_leaf(d, "relay", sca, server=True)
    cli = make_leaf(d, "router", cca, server=False)
    rogue = make_leaf(d, "intruder", rca, server=False)
    return Pki(sca[0], srv[0], srv[1], cca[0], cli[0], cli[1], rogue[0], rogue[1])


def make_crl(
    d: Path,
    name: str,
    ca: tuple[Path, Path],
    revoked: Sequence[Path] = (),
    *,
    last_update: str | None = None,
    next_update: str | None = None,
    md: str = "sha256",
    sigopts: Sequence[str] = (),
) -> Path:
    """A PEM CRL that ``ca`` signs, revoking the certificates ``revoked`` (``openssl ca``'s
    database in a directory of its own); ``last_update`` / ``next_update`` as
    ``YYYYMMDDHHMMSSZ`` (default: now and one day on); ``md`` its digest (``default`` for
    Ed25519), ``sigopts`` such as ``rsa_padding_mode:pss``."""
    work = d / f"{name}.ca"
    work.mkdir()
    (work / "index.txt").write_text("")
    (work / "crlnumber").write_text("01\n")
    conf = work / "ca.cnf"
    conf.write_text(
        "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\ncrlnumber = crlnumber\n"
        f"default_md = {md}\ndefault_crl_days = 1\n"
    )
    keys = ["-config", str(conf.resolve()), "-cert", str(ca[0].resolve()),
            "-keyfile", str(ca[1].resolve())]  # fmt: skip
    for cert in revoked:
        _run("ca", *keys, "-revoke", str(cert.resolve()), cwd=work)
    out = d / f"{name}.crl"
    times = []
    if last_update is not None:
        times += ["-crl_lastupdate", last_update]
    if next_update is not None:
        times += ["-crl_nextupdate", next_update]
    opts = [arg for opt in sigopts for arg in ("-sigopt", opt)]
    _run("ca", *keys, "-gencrl", *times, *opts, "-out", str(out.resolve()), cwd=work)
    return out
