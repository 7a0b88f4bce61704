"""The signature of a ``[tls] client_crl``: a CRL that names a client CA but was signed by
another key (a CA re-keyed under the same subject, a staging CA of the same name) made OpenSSL
refuse every client of that CA at the handshake ("CRL signature failure"), after check-config
and a reload had taken it.

Keys, signatures, CAs and CRLs come from the ``openssl`` CLI at test time. Oracles: OpenSSL's
signatures (``openssl dgst`` / ``pkeyutl``) verified by kvrelay's verifier, bit flips refused,
check-config's problems, the reload's outcome and real mTLS handshakes afterwards.
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvrelay.ops.config import check_file
from kvrelay.ops.crl_signature import verify, verify_crl
from kvrelay.ops.tls import (
    CrlSignatureError,
    ReloadableServerContext,
    ServerTlsFiles,
    client_ssl_context,
)
from kvrelay.ops.worker import TLS_LINE, WorkerControl
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer
from tests.support.certs import CA_KEYS, Pki, make_ca, make_crl, make_pki
from tests.support.rig import relay_info_at as _info

MARKER = 0x4B565231

# AlgorithmIdentifiers (DER) of RFC 4055 / RFC 5758 / RFC 8410.
_ALG = {
    ("rsa", "sha1"): "300d06092a864886f70d0101050500",
    ("rsa", "sha256"): "300d06092a864886f70d01010b0500",
    ("rsa", "sha384"): "300d06092a864886f70d01010c0500",
    ("rsa", "sha512"): "300d06092a864886f70d01010d0500",
    ("ec", "sha256"): "300a06082a8648ce3d040302",
    ("ec", "sha384"): "300a06082a8648ce3d040303",
    ("ed25519", ""): "300506032b6570",
}
_MD5_RSA = bytes.fromhex("2a864886f70d010104")  # md5WithRSAEncryption: not verified here
_SHA256_RSA = bytes.fromhex("2a864886f70d01010b")


def _openssl(*args: str, data: bytes = b"") -> bytes:
    return subprocess.run(["openssl", *args], input=data, check=True, capture_output=True,
                          timeout=60).stdout  # fmt: skip


def _der(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


def _crl_der(path: Path) -> bytes:
    body = path.read_text().split("-----")[2]  # BEGIN X509 CRL-----<body>-----END
    return base64.b64decode("".join(body.split()))


def _write_crl(path: Path, der: bytes) -> Path:
    body = base64.encodebytes(der).decode()
    path.write_text(f"-----BEGIN X509 CRL-----\n{body}-----END X509 CRL-----\n")
    return path


@dataclass(frozen=True)
class Kit:
    pki: Pki
    d: Path
    cas: dict[str, Path]  # key type -> CA certificate (subject CN=<type>-ca)
    crls: dict[str, Path]  # key type (and "pss") -> a CRL that CA signed
    twins: dict[str, Path]  # key type -> a CRL of another key under the same CA name
    corrupt: Path  # the client CA's CRL with one signature byte flipped
    md5: Path  # the rsa CA's CRL relabelled md5WithRSAEncryption (not verifiable here)


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Kit:
    d = tmp_path_factory.mktemp("crlsig")
    pki = make_pki(d)
    cas = {"p256": pki.client_ca}
    crls = {"p256": make_crl(d, "p256", (pki.client_ca, d / "client-ca.key"))}
    twins = {}
    twin_dir = d / "twin"
    twin_dir.mkdir()
    twin = make_ca(twin_dir, "client-ca")  # the client CA's name, another key
    twins["p256"] = make_crl(twin_dir, "p256", twin)
    for kind in ("rsa", "p384", "ed25519", "secp256k1"):
        md = "default" if kind == "ed25519" else "sha384" if kind == "p384" else "sha256"
        ca = make_ca(d, f"{kind}-ca", key_type=kind)
        cas[kind] = ca[0]
        crls[kind] = make_crl(d, kind, ca, md=md)
        if kind in ("rsa", "p384"):
            other = make_ca(twin_dir, f"{kind}-ca", key_type=kind)
            twins[kind] = make_crl(twin_dir, kind, other, md=md)
    rsa = (cas["rsa"], d / "rsa-ca.key")
    crls["pss"] = make_crl(d, "pss", rsa, md="sha384",
                           sigopts=["rsa_padding_mode:pss", "rsa_pss_saltlen:digest"])  # fmt: skip
    der = bytearray(_crl_der(crls["p256"]))
    der[-1] ^= 0x01  # the last byte of the signature (ECDSA's s)
    corrupt = _write_crl(d / "corrupt.crl", bytes(der))
    rsa_der = _crl_der(crls["rsa"])
    at = rsa_der.rindex(_SHA256_RSA)  # the outer signatureAlgorithm
    md5 = _write_crl(d / "md5.crl", rsa_der[:at] + _MD5_RSA + rsa_der[at + len(_MD5_RSA) :])
    return Kit(pki, d, cas, crls, twins, corrupt, md5)


def test_signatures_openssl_makes_verify_and_a_flipped_bit_does_not(tmp_path: Path) -> None:
    """Known answers: OpenSSL signs random bytes with RSA (PKCS#1 v1.5), EC P-256/P-384 and
    Ed25519 keys; the verifier takes each, and refuses it for a flipped bit of the message or
    of the signature."""
    message = secrets.token_bytes(300)
    msg = tmp_path / "msg"
    msg.write_bytes(message)
    cases = [("rsa", h) for h in ("sha1", "sha256", "sha384", "sha512")]
    cases += [("p256", "sha256"), ("p256", "sha384"), ("p384", "sha384"), ("ed25519", "")]
    for kind, md in cases:
        key = tmp_path / f"{kind}.key"
        if not key.exists():
            opts = CA_KEYS[kind][1:-1]  # "-newkey" and "-nodes" left out
            if kind == "rsa":
                _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
                         "-out", str(key))  # fmt: skip
            else:
                _openssl("genpkey", "-algorithm", *opts[:1],
                         *[a for o in opts[2::2] for a in ("-pkeyopt", o)], "-out", str(key))
        spki = _openssl("pkey", "-in", str(key), "-pubout", "-outform", "DER")
        if kind == "ed25519":
            sig = _openssl("pkeyutl", "-sign", "-rawin", "-inkey", str(key), "-in", str(msg))
        else:
            sig = _openssl("dgst", f"-{md}", "-sign", str(key), str(msg))
        family = "ec" if kind.startswith("p") else kind
        alg = bytes.fromhex(_ALG[(family, md)])
        assert verify(spki, alg, message, sig).outcome == "valid", (kind, md)
        for i in (0, len(message) - 1):
            bent = bytearray(message)
            bent[i] ^= 0x80
            assert verify(spki, alg, bytes(bent), sig).outcome == "invalid", (kind, md, i)
        for i in (len(sig) // 2, len(sig) - 1):
            bent = bytearray(sig)
            bent[i] ^= 0x01
            assert verify(spki, alg, message, bytes(bent)).outcome == "invalid", (kind, md, i)


def test_crls_verify_under_their_ca_and_not_under_a_same_name_other_key(kit: Kit) -> None:
    for kind, crl in kit.crls.items():
        ca = kit.cas["rsa" if kind == "pss" else kind]
        verdict = verify_crl(_crl_der(crl), _der(ca))
        expected = "unknown" if kind == "secp256k1" else "valid"  # a curve it does not know
        assert verdict.outcome == expected, (kind, verdict)
    for kind, crl in kit.twins.items():
        assert verify_crl(_crl_der(crl), _der(kit.cas[kind])).outcome == "invalid", kind
    assert verify_crl(_crl_der(kit.corrupt), _der(kit.cas["p256"])).outcome == "invalid"
    md5 = verify_crl(_crl_der(kit.md5), _der(kit.cas["rsa"]))
    assert md5.outcome == "unknown" and "1.2.840.113549.1.1.4" in md5.detail
    # a key of another type can never have signed it
    assert verify_crl(_crl_der(kit.crls["rsa"]), _der(kit.cas["p384"])).outcome == "invalid"


def _config(tmp_path: Path, p: Pki, ca: Path, crl: Path) -> Path:
    path = tmp_path / "kvrelay.toml"
    path.write_text(
        '[relay]\ndc_name = "dc"\n[[pools]]\nnamespace = "ns"\ncomponent = "c"\n'
        'endpoint = "e"\n[[pools.engines]]\nname = "e0"\nhost = "127.0.0.1"\n'
        "grpc_port = 50051\n"
        f'[tls]\ncert = "{p.server_cert}"\nkey = "{p.server_key}"\n'
        f'client_ca = "{ca}"\nclient_crl = "{crl}"\n'
    )
    return path


def test_check_config_refuses_a_crl_its_ca_did_not_sign(kit: Kit, tmp_path: Path) -> None:
    def problems(kind: str, crl: Path) -> list[tuple[str, str]]:
        cfg, found = check_file(_config(tmp_path, kit.pki, kit.cas[kind], crl), env={})
        out: list[tuple[str, str]] = [
            (x.severity, x.reason) for x in found if x.path == "tls.client_crl"
        ]
        assert (cfg is None) == any(s == "error" for s, _r in out), found
        return out

    for kind in ("p256", "rsa", "p384", "ed25519"):
        assert problems(kind, kit.crls[kind]) == [], kind
    assert problems("rsa", kit.crls["pss"]) == []
    for kind, crl in kit.twins.items():
        [(severity, reason)] = problems(kind, crl)
        assert severity == "error", kind
        assert f"issuer CN '{kind if kind != 'p256' else 'client'}-ca') is not signed" in reason
        assert "CRL signature failure" in reason
    [(severity, reason)] = problems("p256", kit.corrupt)
    assert severity == "error" and "is not signed by the key" in reason
    [(severity, reason)] = problems("rsa", kit.md5)
    assert severity == "warning" and "could not be verified" in reason
    [(severity, reason)] = problems("secp256k1", kit.crls["secp256k1"])
    assert severity == "warning" and "curve other than P-256 and P-384" in reason
    # another CA of the same name in the bundle that did sign it: the CRL is fine
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(kit.cas["p256"].read_bytes() + (kit.d / "twin/client-ca.crt").read_bytes())
    cfg, found = check_file(_config(tmp_path, kit.pki, bundle, kit.twins["p256"]), env={})
    assert cfg is not None and not [x for x in found if x.path == "tls.client_crl"], found


async def test_a_reload_refuses_a_crl_its_ca_did_not_sign_and_clients_still_connect(
    kit: Kit,
) -> None:
    """The daemon's start and reload (``ReloadableServerContext``) and a worker's reload line
    refuse the twin's CRL and the corrupted one; the context in use stays, so a fresh client of
    the real CA is still served (with the CRL swapped in, OpenSSL refused it)."""
    p = kit.pki
    def files(crl: Path) -> ServerTlsFiles:
        return ServerTlsFiles(str(p.server_cert), str(p.server_key), str(p.client_ca), str(crl))

    for bad in (kit.twins["p256"], kit.corrupt):
        with pytest.raises(CrlSignatureError, match="is not signed by the key"):
            ReloadableServerContext(files(bad))
    tls = ReloadableServerContext(files(kit.crls["p256"]))
    relay = Relay(RelaySettings(dc_name="dc-crlsig"))
    await relay.start()
    server = RelayServer(relay, relay.limits)
    client = client_ssl_context(str(p.server_ca), str(p.client_cert), str(p.client_key))
    try:
        await server.start("127.0.0.1", 0, ssl=tls.in_use)
        in_use = tls.in_use()
        for bad in (kit.twins["p256"], kit.corrupt):
            with pytest.raises(CrlSignatureError):
                tls.reload(files(bad))
            control = WorkerControl(None, server=server, tls=tls)
            control.line(TLS_LINE + json.dumps(files(bad).as_json()))
            assert tls.in_use() is in_use
            assert (await _info(server.port, client)).relay is not None
    finally:
        await server.close(grace_s=0.5)
        await relay.stop()
