"""Credentials of every kind a NATS deployment uses, made by the test itself: nkeys, an
operator/account/user JWT chain with its ``.creds`` file, a throwaway CA with server and
client certificates (openssl), and server configurations that require each of them.

The JWT writer is the minimum nats-server 2.x accepts: three base64url parts (no padding),
header ``{"typ":"JWT","alg":"ed25519-nkey"}``, claims with ``iss``/``sub``/``nats.type``
and ``version: 2``, signed by the issuer's nkey seed.

Operator mode needs a system account for JetStream: without one nats-server 2.15.1 exits
with "Can't start JetStream: setting up internal jetstream subscriptions failed: system
account not setup". Naming it in the operator JWT (``system_account``) is enough; the
config line says it again for readers.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys


def new_seed(prefix: int) -> bytes:
    """A fresh nkey seed (``S...``) for a key of kind ``prefix`` (nkeys.PREFIX_BYTE_*)."""
    return bytes(nkeys.encode_seed(os.urandom(32), prefix))


def public_key(seed: bytes) -> str:
    return bytes(nkeys.from_seed(bytearray(seed)).public_key).decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_jwt(issuer_seed: bytes, subject: str, name: str, nats: dict[str, Any]) -> str:
    """A JWT for ``subject`` signed by ``issuer_seed``."""
    claims = {"jti": secrets.token_hex(16).upper(), "iat": int(time.time()),
              "iss": public_key(issuer_seed), "name": name, "sub": subject,
              "nats": {**nats, "version": 2}}
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    signature = nkeys.from_seed(bytearray(issuer_seed)).sign(f"{head}.{body}".encode())
    return f"{head}.{body}.{_b64(bytes(signature))}"


#: Account limits with JetStream enabled (unlimited), as ``nsc edit account --js-*`` sets.
_ACCOUNT_LIMITS = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                   "wildcards": True, "conn": -1, "leaf": -1, "mem_storage": -1,
                   "disk_storage": -1, "streams": -1, "consumer": -1}


@dataclass(frozen=True)
class Operator:
    """An operator, a system account and one account with JetStream, and one user."""

    config: str  # nats-server configuration lines (operator mode, memory resolver)
    creds: Path  # the user's .creds file
    user_jwt: str
    user_seed: bytes


def make_operator(workdir: Path) -> Operator:
    op_seed = new_seed(nkeys.PREFIX_BYTE_OPERATOR)
    op_pub = public_key(op_seed)
    sys_seed = new_seed(nkeys.PREFIX_BYTE_ACCOUNT)
    acc_seed = new_seed(nkeys.PREFIX_BYTE_ACCOUNT)
    user_seed = new_seed(nkeys.PREFIX_BYTE_USER)
    sys_pub, acc_pub = public_key(sys_seed), public_key(acc_seed)
    op_jwt = make_jwt(op_seed, op_pub, "OP", {"type": "operator",
                                              "system_account": sys_pub})
    sys_jwt = make_jwt(op_seed, sys_pub, "SYS", {"type": "account", "limits": {
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": True, "conn": -1, "leaf": -1}})
    acc_jwt = make_jwt(op_seed, acc_pub, "APP", {"type": "account",
                                                 "limits": _ACCOUNT_LIMITS})
    user_jwt = make_jwt(acc_seed, public_key(user_seed), "member",
                        {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1,
                         "payload": -1})
    op_file = workdir / "operator.jwt"
    op_file.write_text(op_jwt)
    creds = workdir / "member.creds"
    creds.write_text(
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user_seed.decode()}\n"
        "------END USER NKEY SEED------\n")
    creds.chmod(0o600)
    config = (f'operator: "{op_file}"\n'
              f"system_account: {sys_pub}\n"
              "resolver: MEMORY\n"
              f"resolver_preload: {{\n  {sys_pub}: \"{sys_jwt}\"\n"
              f"  {acc_pub}: \"{acc_jwt}\"\n}}\n")
    return Operator(config, creds, user_jwt, user_seed)


@dataclass(frozen=True)
class Pki:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost, a client one."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(workdir: Path) -> Pki:
    d = workdir / "pki"
    d.mkdir(exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=cgroupd test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                 "extendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", "-subj", f"/CN=cgroupd-{name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem",
                 "-extfile", f"{name}.ext", cwd=d)
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
               d / "client.key")


def tls_config(pki: Pki, *, verify: bool = True, handshake_first: bool = False) -> str:
    """A server ``tls {}`` block: mutual TLS (``verify``) and/or TLS-first."""
    lines = [f'cert_file: "{pki.server_cert}"', f'key_file: "{pki.server_key}"',
             f'ca_file: "{pki.ca}"']
    if verify:
        lines.append("verify: true")
    if handshake_first:
        lines.append("handshake_first: true")
    return "tls {\n  " + "\n  ".join(lines) + "\n}\n"
