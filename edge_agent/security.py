"""ZeroMQ CURVE: keys, and the authenticator that admits only allow-listed clients.

Off by default (endpoints bind to loopback).  On a factory network the line
config names the agent's secret certificate and the clients' public keys;
a client whose key is not listed never gets a connection, so its frames are
never read, let alone acked.
"""
from __future__ import annotations

import logging
import os
import stat
import struct
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from coe import CoEError

log = logging.getLogger(__name__)


_SECRET_BANNER = ("#   ZeroMQ CURVE **Secret** Certificate (coe-agent keys generate)\n"
                  "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\n")
_PUBLIC_BANNER = ("#   ZeroMQ CURVE Public Certificate (coe-agent keys generate)\n"
                  "#   Give it to the other side; check it arrived unchanged.\n\n")


def generate(out_dir: str | Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write `name.key` (public) and `name.key_secret` (secret, owner-only) into `out_dir`.

    The secret file is created owner-only (never readable by others, not even
    for a moment) and never through a link.  An existing keypair is kept
    unless `force`: replacing a key silently locks out every client that
    trusts the old one.  The files are pyzmq certificates (`load_keys` reads
    them).
    """
    _check_key_name(name)
    out = Path(out_dir)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    if not force:
        for p in (secret, public):
            if os.path.lexists(p):
                raise CoEError(f"CURVE key file {p} already exists: not replaced (clients that trust it would be "
                               "refused); pass --force to make a new keypair anyway")
    _key_dir(out)
    pub_key, sec_key = zmq.curve_keypair()
    _write_new(secret, 0o600, _certificate(_SECRET_BANNER, pub_key, sec_key))
    _write_new(public, 0o644, _certificate(_PUBLIC_BANNER, pub_key))
    return public, secret


def _check_key_name(name: str) -> None:
    """NAME becomes two file names in the output folder: a path (`../x`) would write elsewhere, a leading dot
    hidden files, an empty one files named only `.key`."""
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if not name or name.startswith(".") or any(c in name for c in seps) or "\0" in name:
        raise CoEError(f"key name {name!r}: must be a plain file name (not empty, no path separator, not starting "
                       "with '.'), e.g. 'server' or 'aoi-1'")


def _key_dir(out: Path) -> None:
    """Make `out` owner-only; one that exists keeps its mode (it may be shared on purpose) with a warning when
    others can list it, or write in it (they could replace a key with one of theirs)."""
    if not out.is_dir():
        out.mkdir(parents=True, mode=0o700)
        return
    mode = stat.S_IMODE(out.stat().st_mode)
    if mode & 0o077:
        what = ("others can write in it and replace the keys" if mode & 0o022 else
                "others can list it (the secret key file itself is owner-only)")
        log.warning("key folder %s has mode %o: %s; chmod 700 %s to keep it private", out, mode, what, out)


def _write_new(path: Path, mode: int, text: str) -> None:
    """Create `path` with `mode` from the first byte (O_EXCL: never through a link or into an old file's mode),
    replacing a file that is there."""
    if os.path.lexists(path):
        path.unlink()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _certificate(banner: str, public: bytes, secret: bytes | None = None) -> str:
    """A ZeroMQ certificate as pyzmq writes one (`zmq.auth.load_certificate` reads it)."""
    lines = [banner + "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def load_keys(path: str | Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a certificate, both checked here so that a bad key is an error naming the
    file now, not a bare ZMQError when a socket takes it (a truncated secret) or a server no client can reach
    (a secret that is not the public key's).  Key files others could replace are warned about."""
    p = Path(path)
    if not p.is_file():
        raise CoEError(f"CURVE key file {p} does not exist (make one with `coe-agent keys generate`)")
    try:
        public, sec = zmq.auth.load_certificate(str(p))
    except (OSError, ValueError) as exc:
        raise CoEError(f"CURVE key file {p} is not a ZeroMQ certificate: {exc}") from None
    except IndexError:          # pyzmq splits `public-key = "..."` at '=' without checking there is one
        raise CoEError(f"CURVE key file {p} is not a ZeroMQ certificate: a public-key or secret-key line has "
                       "no '='") from None
    if not _is_z85_key(public):
        raise CoEError(f"CURVE key file {p}: its public key is not 40 characters of z85")
    if secret and not sec:
        raise CoEError(f"CURVE key file {p} holds no secret key (use the *.key_secret file)")
    if sec:
        if not _is_z85_key(sec):
            raise CoEError(f"CURVE key file {p}: its secret key is not 40 characters of z85 (a truncated or "
                           "edited file?)")
        try:
            pair = zmq.curve_public(sec) == public
        except zmq.ZMQError as exc:
            raise CoEError(f"CURVE key file {p}: cannot check its secret key ({exc}; does this libzmq have "
                           "CURVE?)") from None
        if not pair:
            raise CoEError(f"CURVE key file {p}: its secret key does not belong to its public key (keys from "
                           "two certificates?); make a new pair with `coe-agent keys generate`")
        _warn_if_exposed(p)
    _warn_if_replaceable(p)
    return public, sec


def _warn_if_exposed(p: Path) -> None:
    """A secret key others can read is no secret: anyone who read it can pose as this side."""
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        log.warning("CURVE secret key file %s has mode %o: others can read it; chmod 600 %s (and make a new "
                    "pair if it was exposed)", p, mode, p)


def _warn_if_replaceable(p: Path) -> None:
    """In a folder others can write, a key file can be swapped: a client's key for one of theirs."""
    folder = p.parent
    mode = stat.S_IMODE(folder.stat().st_mode)
    if mode & 0o022:
        log.warning("CURVE key folder %s has mode %o: others can replace %s with a key of theirs; chmod go-w %s",
                    folder, mode, p.name, folder)


_Z85 = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def _is_z85_key(key: bytes) -> bool:
    """40 z85 characters that decode: `"#" * 40` is all z85 characters but no 32-bit groups, and would only
    fail when a socket takes it, or be a key no client has."""
    if len(key) != 40 or not all(c in _Z85 for c in key):
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, struct.error):
        return False


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
        ok = z85.encode(key) in self.keys if len(key) == 32 else key in self.keys
        if not ok:
            log.warning("CURVE: refused a client with an unknown public key")
        return ok


def start_authenticator(ctx: zmq.Context, curve) -> tuple[ThreadAuthenticator, tuple[bytes, bytes]]:
    """The authenticator admitting `curve.allowed_clients`, and the server's keys.

    An empty allow-list is refused: the agent would start and refuse every client without a word, and a
    line that means to take no frames has no reason to run an agent.
    """
    if not curve.allowed_clients:
        raise CoEError("curve.allowed_clients is empty: with CURVE on, the agent would refuse every client; list "
                       "the clients' public keys (certificate files or 40-character z85 keys)")
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
