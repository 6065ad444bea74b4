"""`security.generate`: the secret key is owner-only from its first byte, keys are never silently replaced,
and a key NAME cannot write anywhere but the output folder.  Real files in a temporary folder."""
from __future__ import annotations

import logging
import os
import stat
import sys

import pytest

from coe import CoEError
from edge_agent.security import generate, load_keys

_watch: dict = {"path": None, "seen": []}


def _audit(event: str, args) -> None:
    """Whenever generate() touches a file, note whether the secret file exists holding a key others can read."""
    path = _watch["path"]
    if path is None or event not in ("open", "os.chmod", "os.rename", "os.replace", "os.remove", "os.unlink"):
        return
    _watch["path"] = None                       # no re-entry through our own stat
    try:
        st = os.stat(path)
        _watch["seen"].append((event, stat.S_IMODE(st.st_mode), st.st_size))
    except OSError:
        pass
    finally:
        _watch["path"] = path


sys.addaudithook(_audit)                        # (hooks cannot be removed: it is idle while path is None)


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_the_secret_key_is_never_readable_by_others_not_even_while_it_is_written(tmp_path):
    old = os.umask(0o022)                       # a usual umask: a plain open() makes files world-readable
    _watch.update(path=str(tmp_path / "keys" / "server.key_secret"), seen=[])
    try:
        public, secret = generate(tmp_path / "keys", "server")
    finally:
        _watch["path"] = None
        os.umask(old)
    assert mode(secret) == 0o600 and mode(tmp_path / "keys") == 0o700
    readable = [s for s in _watch["seen"] if s[2] > 0 and s[1] & 0o077]
    assert _watch["seen"] and readable == []    # it was seen written, and never readable by others
    assert load_keys(secret, secret=True)[0] == load_keys(public, secret=False)[0]


def test_an_existing_keypair_is_kept_unless_forced(tmp_path):
    public, secret = generate(tmp_path, "server")
    before = (public.read_bytes(), secret.read_bytes())
    with pytest.raises(CoEError, match=f"{secret}.*already exists.*--force"):
        generate(tmp_path, "server")
    assert (public.read_bytes(), secret.read_bytes()) == before
    secret.unlink()                             # half a pair: still refused, the public key is trusted somewhere
    with pytest.raises(CoEError, match=f"{public}.*already exists.*--force"):
        generate(tmp_path, "server")
    assert generate(tmp_path, "server", force=True) == (public, secret)
    assert public.read_bytes() != before[0] and mode(secret) == 0o600
    assert load_keys(secret, secret=True)[0] == load_keys(public, secret=False)[0]


def test_forcing_replaces_a_planted_link_and_never_writes_through_it(tmp_path):
    bait = tmp_path / "bait.txt"
    bait.write_text("someone else's file\n")
    bait.chmod(0o644)
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    (keys / "server.key_secret").symlink_to(bait)
    with pytest.raises(CoEError, match="already exists"):
        generate(keys, "server")
    _, secret = generate(keys, "server", force=True)
    assert bait.read_text() == "someone else's file\n"
    assert not secret.is_symlink() and mode(secret) == 0o600


@pytest.mark.parametrize("name", ["", "../outside", "sub/server", ".hidden", "..", "a\\b"])
def test_a_key_name_that_is_not_a_plain_file_name_is_refused(tmp_path, name):
    out = tmp_path / "keys"
    with pytest.raises(CoEError, match="key name .*plain file name"):
        generate(out, name)
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / "outside.key").exists()   # nothing written


def test_an_existing_folder_others_can_list_is_kept_with_a_warning(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="edge_agent.security"):
        _, secret = generate(shared, "aoi-1")
    assert mode(shared) == 0o755 and mode(secret) == 0o600
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(shared) in warned[0] and "755" in warned[0] and "chmod 700" in warned[0]
