"""ZeroMQ CURVE: keys, and the authenticator that admits only allow-listed clients.

Off by default (endpoints bind to loopback).  On a factory network the line
config names the agent's secret certificate and the clients' public keys;
a client whose key is not listed never gets a connection, so its frames are
never read, let alone acked.
"""
from __future__ import annotations

import logging
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from coe import CoEError

log = logging.getLogger(__name__)


def generate(out_dir: str | Path, name: str) -> tuple[Path, Path]:
    """Write `name.key` (public) and `name.key_secret` (secret, owner-only) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.auth.create_certificates(str(out), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_keys(path: str | Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise CoEError(f"CURVE key file {p} does not exist (make one with `coe-agent keys generate`)")
    try:
        public, sec = zmq.auth.load_certificate(str(p))
    except (OSError, ValueError) as exc:
        raise CoEError(f"CURVE key file {p} is not a ZeroMQ certificate: {exc}") from None
    if not _is_z85_key(public):
        raise CoEError(f"CURVE key file {p}: its public key is not 40 characters of z85")
    if secret and not sec:
        raise CoEError(f"CURVE key file {p} holds no secret key (use the *.key_secret file)")
    return public, sec


_Z85 = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def _is_z85_key(key: bytes) -> bool:
    return len(key) == 40 and all(c in _Z85 for c in key)


def client_key(entry: str, where: str = "curve.allowed_clients") -> bytes:
    """An allow-list entry: a 40-character z85 public key, or a certificate file holding one.

    A 40-character entry that is not a file must be a z85 key: a mistyped
    path or key would otherwise be taken as a key no client has, and that
    client would be refused without a word.  One ending in `.key` (what
    `coe-agent keys generate` writes) is read as a path.  A mistyped path of
    z85 characters only (letters, digits, `/`, `.`, `-`) cannot be told from
    a key and is still taken as one.
    """
    if len(entry) == 40 and not Path(entry).exists() and not entry.endswith((".key", ".key_secret")):
        key = entry.encode("ascii", errors="replace") if entry.isascii() else b""
        if not _is_z85_key(key):
            raise CoEError(f"{where}: {entry!r} is neither a z85 public key (40 characters of the z85 alphabet) nor "
                           f"an existing certificate file")
        return key
    return load_keys(entry, secret=False)[0]


class _AllowList:
    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        from zmq.utils import z85

        ok = z85.encode(key) in self.keys if len(key) == 32 else key in self.keys
        if not ok:
            log.warning("CURVE: refused a client with an unknown public key")
        return ok


def start_authenticator(ctx: zmq.Context, curve) -> tuple[ThreadAuthenticator, tuple[bytes, bytes]]:
    public, secret = load_keys(curve.server_key, secret=True)
    allowed = {client_key(c, f"curve.allowed_clients[{i}]") for i, c in enumerate(curve.allowed_clients)}
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(allowed))
    return auth, (public, secret)


def client_setup(client_key_file: str | Path, server_public_file: str | Path):
    """A socket_setup for the replay client: this client's keys plus the agent's public key."""
    pub, sec = load_keys(client_key_file, secret=True)
    server_pub, _ = load_keys(server_public_file, secret=False)

    def setup(sock: zmq.Socket) -> None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = pub, sec, server_pub
    return setup
