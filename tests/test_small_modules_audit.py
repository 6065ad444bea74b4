"""Audit findings in small modules: CURVE keys, the instance lock, bind hints, thumbnails, metrics, runtime auto,
the page cache, solder bridges, read-ahead's close and the link profile.  Each bad input is an error naming what is
wrong (or a value the caller already handles), never a traceback; real files in a temporary folder."""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
import types

import numpy as np
import pytest
import zmq

from coe import CoEError, parse_spec

from conftest import TINY_SPEC


# -- CURVE keys (edge_agent.security) ------------------------------------------------------------------------

@pytest.fixture
def keys(tmp_path):
    from edge_agent.security import generate

    folder = tmp_path / "keys"
    public, secret = generate(folder, "server")
    return folder, public, secret


def _cert(path, public: bytes, secret: bytes | None = None, mode: int = 0o600):
    text = f'curve\n    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_key_line_without_an_equals_sign_is_an_error_naming_the_file(keys):
    from edge_agent.security import load_keys

    bad = keys[0] / "bad.key"
    bad.write_text("curve\n    public-key\n")
    with pytest.raises(CoEError, match=f"{bad} is not a ZeroMQ certificate: .*no '='"):
        load_keys(bad, secret=False)


def test_a_truncated_or_foreign_secret_key_is_refused_when_read_not_when_a_socket_takes_it(keys):
    from edge_agent.security import load_keys

    folder, public, secret = keys
    pub, sec = load_keys(secret, secret=True)
    assert zmq.curve_public(sec) == pub                     # the pair as generated loads
    short = _cert(folder / "short.key_secret", pub, sec[:-5])
    with pytest.raises(CoEError, match=f"{short}: its secret key is not 40 characters of z85"):
        load_keys(short, secret=True)
    undecodable = _cert(folder / "hash.key_secret", pub, b"#" * 40)       # z85 characters, no 32-bit groups
    with pytest.raises(CoEError, match=f"{undecodable}: its secret key is not 40 characters of z85"):
        load_keys(undecodable, secret=True)
    _, other_sec = zmq.curve_keypair()
    mixed = _cert(folder / "mixed.key_secret", pub, other_sec)
    with pytest.raises(CoEError, match=f"{mixed}: its secret key does not belong to its public key"):
        load_keys(mixed, secret=True)
    with pytest.raises(CoEError, match="does not belong"):                # also when only the public key is wanted
        load_keys(mixed, secret=False)


def test_a_public_key_of_z85_characters_that_does_not_decode_is_refused(keys):
    from edge_agent.security import client_key, load_keys

    with pytest.raises(CoEError, match=r"curve.allowed_clients\[0\]: .* is neither a z85 public key"):
        client_key("#" * 40, "curve.allowed_clients[0]")
    bad = _cert(keys[0] / "hash.key", b"%" * 40, mode=0o644)
    with pytest.raises(CoEError, match=f"{bad}: its public key is not 40 characters of z85"):
        load_keys(bad, secret=False)
    good = load_keys(keys[1], secret=False)[0]
    assert client_key(good.decode()) == good


def test_curve_with_no_allowed_client_refuses_to_start_naming_the_field(keys):
    from edge_agent.security import start_authenticator

    ctx = zmq.Context()
    started = []
    try:
        with pytest.raises(CoEError, match=r"curve\.allowed_clients is empty: .*refuse every client"):
            started.append(start_authenticator(ctx, types.SimpleNamespace(server_key=str(keys[2]),
                                                                          allowed_clients=[])))
    finally:
        for auth, _ in started:     # one that started would keep the context from closing
            auth.stop()
        ctx.term()


def test_key_files_others_can_read_or_replace_are_warned_about(tmp_path, caplog):
    from edge_agent.security import generate, load_keys

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="edge_agent.security"):
        public, secret = generate(shared, "server")
    made = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(made) == 1 and "777" in made[0] and "replace the keys" in made[0]
    caplog.clear()
    secret.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="edge_agent.security"):
        pub, sec = load_keys(secret, secret=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(secret) in w and "644" in w and "others can read it" in w for w in warned)
    assert any(str(shared) in w and "777" in w and "others can replace" in w for w in warned)
    assert not any(sec.decode() in w for w in warned)              # never the secret itself
    caplog.clear()
    shared.chmod(0o700)
    secret.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="edge_agent.security"):
        load_keys(secret, secret=True)
        load_keys(public, secret=False)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


# -- the instance lock ---------------------------------------------------------------------------------------

def test_a_file_system_without_locks_is_an_error_naming_the_lock_file(tmp_path, monkeypatch):
    from edge_agent import instance_lock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(instance_lock, "fcntl", types.SimpleNamespace(LOCK_EX=2, LOCK_NB=4, flock=no_locks))
    lock = instance_lock.InstanceLock(tmp_path / "results.db")
    with pytest.raises(CoEError, match=f"cannot lock {lock.path}: No locks available; .*may not support locks"):
        lock.acquire()
    assert not lock.held


# -- bind hints ----------------------------------------------------------------------------------------------

def test_a_refused_bind_gets_the_hint_of_its_kind_of_endpoint():
    from edge_agent.bind_errors import why_bind_failed

    ipc = zmq.ZMQError(errno.EACCES, "Permission denied (addr='ipc:///run/coe/ingest.sock')")
    assert "folder is not writable" in why_bind_failed(ipc) and "1024" not in why_bind_failed(ipc)
    low = zmq.ZMQError(errno.EACCES, "Permission denied (addr='tcp://0.0.0.0:80')")
    assert "ports below 1024 need privileges" in why_bind_failed(low)
    denied = OSError(errno.EACCES, "Permission denied")
    assert why_bind_failed(denied, "0.0.0.0:9100") == "Permission denied"     # a high port: no privilege hint
    assert "ports below 1024" in why_bind_failed(denied, "[::1]:443")
    assert "folder is not writable" in why_bind_failed(denied, "ipc:///tmp/x.sock")


# -- thumbnails ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16, bool])
def test_a_frame_that_is_not_uint8_gets_no_thumbnail(dtype):
    from edge_agent.thumbnails import make_thumbnail

    assert make_thumbnail(np.ones((32, 32, 3), dtype=dtype)) is None
    assert make_thumbnail(np.ones((32, 32, 3), dtype=np.uint8))[:2] == b"\xff\xd8"   # a JPEG, as before


# -- metrics -------------------------------------------------------------------------------------------------

def test_load_seconds_that_are_not_a_finite_number_are_skipped_and_logged_once(caplog):
    from edge_agent.metrics import Metrics

    m = Metrics("A")

    def load_seconds() -> float:
        return m.registry.get_sample_value("coe_expert_load_seconds_total", {"line": "A", "tier": "host@n1"})

    with caplog.at_level(logging.WARNING, logger="edge_agent.metrics"):
        m.expert_event("host@n1", "load", 0.5)
        for bad in (-1.0, float("nan"), float("inf"), None, "2", True):
            m.expert_event("host@n1", "load", bad)
    assert load_seconds() == 0.5 and math.isfinite(load_seconds())
    assert m.registry.get_sample_value("coe_expert_loads_total", {"line": "A", "tier": "host@n1"}) == 7
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "-1.0" in warned[0]


# -- runtime auto --------------------------------------------------------------------------------------------

def test_an_arch_whose_measurement_fails_stays_on_torch_and_the_others_are_kept(tmp_path, caplog):
    from edge_agent.runtime_select import RUNTIMES_FILE, measured_choices, runtime_key

    experts = list(parse_spec(TINY_SPEC).experts.values())
    keys = list(dict.fromkeys(runtime_key(e) for e in experts))
    assert len(keys) >= 2
    broken = keys[0]
    calls = []

    def measure(e):
        calls.append(runtime_key(e))
        if runtime_key(e) == broken:
            raise RuntimeError("export failed: unsupported op")
        return {"auto": "onnx"}
    path = tmp_path / RUNTIMES_FILE
    with caplog.at_level(logging.WARNING, logger="edge_agent.runtime_select"):
        got = measured_choices(path, experts, threads=2, measure=measure)
    assert got == {k: "torch" if k == broken else "onnx" for k in keys}
    row = json.loads(path.read_text())["archs"][broken]
    assert row["auto"] == "torch" and "export failed: unsupported op" in row["error"]
    assert any(broken in r.getMessage() and "unsupported op" in r.getMessage() for r in caplog.records)
    assert measured_choices(path, experts, threads=2, measure=measure) == got and len(calls) == len(keys)


def test_each_arch_measured_is_kept_even_when_the_start_stops_half_way(tmp_path):
    from edge_agent.runtime_select import RUNTIMES_FILE, measured_choices, runtime_key

    class Stopped(BaseException):       # a Ctrl-C during the measurements: not caught, the start ends
        pass
    experts = list(parse_spec(TINY_SPEC).experts.values())
    keys = list(dict.fromkeys(runtime_key(e) for e in experts))

    def measure(e):
        if runtime_key(e) == keys[1]:
            raise Stopped
        return {"auto": "onnx"}
    path = tmp_path / RUNTIMES_FILE
    with pytest.raises(Stopped):
        measured_choices(path, experts, threads=2, measure=measure)
    assert json.loads(path.read_text())["archs"] == {keys[0]: {"auto": "onnx"}}


# -- the page cache ------------------------------------------------------------------------------------------

def test_anything_but_a_regular_file_is_neither_dropped_warmed_nor_measured(tmp_path):
    from storage.pagecache import drop_from_page_cache, resident_fraction, warm_page_cache

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)   # held open: code that opens it blocking does not hang
    try:
        assert resident_fraction(fifo) is None          # not 1.0: nothing of it is cached
        assert drop_from_page_cache(fifo) is False
        assert warm_page_cache(fifo) == 0
    finally:
        os.close(writer)
    assert warm_page_cache(tmp_path) == 0 and drop_from_page_cache(tmp_path) is False
    assert resident_fraction(tmp_path) is None
    f = tmp_path / "expert.bin"
    f.write_bytes(b"x" * 10000)
    assert warm_page_cache(f) == 10000 and drop_from_page_cache(f) is True


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EROFS])
def test_a_file_system_that_cannot_fsync_still_drops(tmp_path, monkeypatch, code):
    from storage import pagecache

    f = tmp_path / "expert.bin"
    f.write_bytes(b"x" * 10000)

    def cannot(fd):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(pagecache.os, "fsync", cannot)
    assert pagecache.drop_from_page_cache(f) is True


def test_a_failing_fsync_for_another_reason_is_still_raised(tmp_path, monkeypatch):
    from storage import pagecache

    f = tmp_path / "expert.bin"
    f.write_bytes(b"x")

    def broken(fd):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(pagecache.os, "fsync", broken)
    with pytest.raises(OSError, match="Input/output error"):
        pagecache.drop_from_page_cache(f)
    monkeypatch.undo()
    if os.path.exists("/proc/self/status"):             # procfs cannot fsync (EINVAL): nothing dirty to drop
        assert pagecache.drop_from_page_cache("/proc/self/status") is True


# -- solder bridges ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("component", ["U-QFP8", "U-QFP4", "U-LQFP8", "U-QFP10", "U-QFN4"])
def test_every_defect_applicable_names_can_be_drawn_on_a_small_quad(component):
    from storage.solder import applicable, draw_solder_defect

    assert "solder_bridge" in applicable(component)
    for defect in applicable(component):
        for seed in range(4):
            img, (x0, y0, x1, y1) = draw_solder_defect(component, defect, np.random.default_rng(seed))
            assert img.shape == (64, 64, 3) and 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64


# -- read-ahead's close --------------------------------------------------------------------------------------

def test_a_read_ahead_stuck_in_a_read_is_logged_at_close_and_reported_alive(monkeypatch, caplog):
    from executors import readahead
    from storage.disk_activity import DiskActivity

    entered, release = threading.Event(), threading.Event()

    class StuckHost:
        def present(self, eid):
            return False

        def acquire(self, eid, keep=()):
            entered.set()
            release.wait(60)            # a read that hangs until the test lets it go
            return None

    monkeypatch.setattr(readahead, "JOIN_SECONDS", 0.05)
    ahead = readahead.ReadAhead(lambda: [("gpu0", ["a", "b"])], lambda n, e: True, lambda: [], StuckHost(),
                                DiskActivity(), poll=0.001)
    ahead.start()
    try:
        assert entered.wait(60)
        with caplog.at_level(logging.ERROR, logger="executors.readahead"):
            ahead.close()
        assert ahead.alive()
        assert any("still running" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    finally:
        release.set()
    ahead._thread.join(60)
    assert not ahead.alive()


# -- the link profile ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("doc, field", [
    ({"links": {"n1": {"bandwidth_bps": 10 ** 400, "latency_s": 0.001}}}, "links.n1: bandwidth_bps"),
    ({"links": {"n1": {"bandwidth_bps": True, "latency_s": 0.001}}}, "links.n1: bandwidth_bps: must be a number"),
    ({"links": {"n1": {"bandwidth_bps": 1e9, "latency_s": False}}}, "links.n1: latency_s: must be a number"),
    ({"links": {}, "frame_bytes": 10 ** 400}, "frame_bytes: must be a positive integer"),
])
def test_a_link_profile_with_a_number_no_float_holds_or_a_boolean_is_refused(tmp_path, doc, field):
    from executors.links import Links

    path = tmp_path / "links.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CoEError, match=f"{path}: malformed link profile: {field}"):
        Links.load(path)


def test_a_link_profile_path_that_is_a_folder_is_an_error_naming_it(tmp_path):
    from executors.links import Links

    with pytest.raises(CoEError, match=f"{tmp_path}: cannot read the link profile: Is a directory"):
        Links.load(tmp_path)
    (tmp_path / "ok.json").write_text(json.dumps({"links": {"n1": {"bandwidth_bps": "1e9", "latency_s": 0}}}))
    assert Links.load(tmp_path / "ok.json").links["n1"].bandwidth_bps == 1e9
