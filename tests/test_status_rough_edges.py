"""What a new user met (issue 14): decoder noise on stderr, ultralytics chatter, the demo's results, the chart."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import cv2
import numpy as np
import pytest
from click.testing import CliRunner

from edge_agent import protocol as P
from edge_agent.cli import cli, quiet_third_party
from edge_agent.config import load_config
from edge_agent.demo import demo_db_path, results_command
from edge_agent.ingest import check_frame
from routing import RuleRouter
from storage.results import JournalEntry, ResultStore

from conftest import TINY_SPEC, write_line


def _corrupt_png() -> bytes:
    """A PNG whose header, chunk CRCs and IEND are fine but whose compressed pixels are not."""
    img = np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)
    png = bytearray(cv2.imencode(".png", img)[1].tobytes())
    start = png.index(b"IDAT") + 4
    png[start + 10:start + 60] = bytes(50)
    crc = zlib.crc32(bytes(png[start - 4:start + int.from_bytes(png[start - 8:start - 4], "big")]))
    end = start + int.from_bytes(png[start - 8:start - 4], "big")
    png[end:end + 4] = crc.to_bytes(4, "big")
    return bytes(png)


def test_undecodable_images_are_rejected_with_the_decoders_words_and_nothing_on_stderr(capfd):
    from coe import parse_spec

    router = RuleRouter(parse_spec(TINY_SPEC))
    header = json.dumps({"v": 1, "frame_id": "f1", "line": "T", "board_id": "B", "component": "R0402", "ts": 1.0,
                         "encoding": "png"}).encode()
    capfd.readouterr()
    with pytest.raises(P.Reject) as rej:
        check_frame([header, _corrupt_png()], line="T", router=router, max_payload=1 << 20)
    assert rej.value.reason == P.BAD_IMAGE and "could not be decoded: " in rej.value.detail
    assert len(rej.value.detail) > len("png payload could not be decoded: ")   # the decoder's own reason
    jpg = bytearray(cv2.imencode(".jpg", np.full((64, 64, 3), 90, np.uint8))[1].tobytes())
    jpg[200:260] = b"\x13" * 60          # corrupt scan data, markers intact: libjpeg would warn on stderr
    header_j = header.replace(b'"png"', b'"jpeg"')
    try:
        check_frame([header_j, bytes(jpg)], line="T", router=router, max_payload=1 << 20)
    except P.Reject as exc:
        assert exc.reason == P.BAD_IMAGE
    # ultralytics replaces PIL's Image.open on import with one that tries to install a HEIF plugin whenever
    # Pillow cannot identify a file: the decoder must not go through it
    import ultralytics.utils.patches  # noqa: F401

    ihdr = b"\x00\x00\x00\x0dIHDR" + (40).to_bytes(4, "big") * 2 + b"\x08\x02\x00\x00\x00" + b"\x00\x00\x00\x00"
    unidentifiable = b"\x89PNG\r\n\x1a\n" + ihdr + b"\x00\x00\x00\x00IEND\xaeB`\x82"
    with pytest.raises(P.Reject) as rej:
        check_frame([header, unidentifiable], line="T", router=router, max_payload=1 << 20)
    assert rej.value.reason == P.BAD_IMAGE and "could not be decoded" in rej.value.detail
    out = capfd.readouterr()
    assert out.err == "" and out.out == ""


def test_a_good_png_decodes_to_the_same_pixels_as_before():
    img = np.random.default_rng(1).integers(0, 255, (33, 47, 3), dtype=np.uint8)
    header = P.Header(1, "f", "T", "B", "R0402", 1.0, "png")
    got = P.decode_image(header, cv2.imencode(".png", cv2.cvtColor(img, cv2.COLOR_RGB2BGR))[1].tobytes())
    assert got.dtype == np.uint8 and np.array_equal(got, img)


def test_ultralytics_says_nothing_when_the_cli_has_quieted_it(tmp_path):
    env = {"YOLO_VERBOSE": "True"}
    quiet_third_party(env)
    assert env == {"YOLO_VERBOSE": "True", "YOLO_OFFLINE": "1"}       # a variable already set wins
    # a fresh settings dir is where ultralytics announces the file it creates
    child = {k: v for k, v in os.environ.items() if not k.startswith("YOLO_")}
    child["YOLO_CONFIG_DIR"] = str(tmp_path / "ultralytics")
    code = "from edge_agent.cli import quiet_third_party; quiet_third_party(); import ultralytics.utils"
    run = subprocess.run([sys.executable, "-c", code], env=child, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "" and run.stderr == ""
    assert (tmp_path / "ultralytics").is_dir()            # it did start and write its settings, silently


def test_results_finds_the_demos_database_until_the_line_has_its_own(tmp_path):
    path = write_line(tmp_path / "line", store=tmp_path / "experts")
    cfg = load_config(path, env={})
    demo = demo_db_path(cfg)
    rs = ResultStore(demo)
    rs.journal([JournalEntry("demo-1", "T", "B1", "R0402", 1.0, 2.0, "{}", b"x")])
    rs.write(verdicts=[{"frame_id": "demo-1", "verdict": "defect", "reason": "cls: missing", "decided_at": 3.0,
                        "latency_ms": 4.0, "chain": '["cls-r0402"]'}])
    rs.close()
    assert results_command(cfg, str(path)) == f"coe-agent results --line T --config {path} --verdict defect --limit 10"
    out = CliRunner().invoke(cli, ["results", "--config", str(path)])
    assert out.exit_code == 0, out.output
    assert "demo-1" in out.stdout and str(demo) in out.stderr
    ResultStore(cfg.db_path).close()                     # the line's agent has run: its database wins
    out = CliRunner().invoke(cli, ["results", "--config", str(path)])
    assert out.exit_code == 0 and "no verdicts match" in out.stdout
    assert f"--db {demo}" in results_command(cfg)
    out = CliRunner().invoke(cli, ["results", "--config", str(path), "--since", "last tuesday"])
    assert out.exit_code == 2 and "--since" in out.stderr


@pytest.mark.parametrize("workloads, systems", [(["A1"], 3), (["A1", "A2", "B1", "B2"], 13)])
def test_the_bench_chart_keeps_its_whole_title_and_legend_inside_the_figure(workloads, systems):
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from edge_agent.bench import chart

    title = ("simulation on profile: assumed: documented GPU-class profile (not measured here). RTX 3080 Ti-class "
             "GPU with 12 GB and a 16-core CPU with 32 GB, SATA SSD 530 MB/s; costs from the papers")
    names = ["coserve", "coserve-paper", "samba", "samba-fifo", "samba-parallel", "none", "em", "em+ra", "-ssd",
             "-steal", "-exclusive", "-age", "-protect"][:systems]
    fig = chart({w: [{"system": s, "throughput": 10.0 + i} for i, s in enumerate(names)] for w in workloads}, title)
    try:
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        ax = fig.axes[0]
        text = ax.get_title(loc="left")
        assert text.replace("\n", " ") == title                                # nothing cut from the text
        shown = next(c for c in ax.get_children() if isinstance(c, Text) and c.get_text() == text)
        box, fig_box = shown.get_window_extent(r), fig.bbox
        assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1 and box.y1 <= fig_box.y1 and box.y0 >= 0
        legend = fig.legends[0].get_window_extent(r)
        assert legend.y1 <= ax.get_window_extent(r).y0 and legend.y0 >= 0      # below the bars, not over them
        colours = {tuple(p.get_facecolor()) for p in ax.patches}
        assert len(colours) == systems                                         # one colour per system
    finally:
        plt.close(fig)


def test_the_latency_chart_draws_a_panel_per_task_a_line_per_system_and_the_target():
    """`bench/sim_rates.py --plot`: p99 against the rate.  Each system's points are where it was measured,
    the y axis is logarithmic (past a system's sustained rate p99 climbs by orders of magnitude), and the
    dashed target line is on every panel."""
    import matplotlib.pyplot as plt

    from edge_agent.bench import latency_chart

    p99 = {"coserve": {8.6: {"A1": 0.9, "B2": 0.7}, 16.7: {"A1": 1.8, "B2": 2.1}},
           "samba": {8.6: {"A1": 40.0, "B2": 35.0}}}
    fig = latency_chart(p99, "test")
    try:
        fig.canvas.draw()
        assert [ax.get_title() for ax in fig.axes] == ["A1", "B2"]
        for ax, t in zip(fig.axes, ["A1", "B2"]):
            assert ax.get_yscale() == "log"
            lines = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
            assert set(lines) == {"coserve", "samba"}
            assert list(lines["coserve"].get_xdata()) == [8.6, 16.7]
            assert list(lines["coserve"].get_ydata()) == [p99["coserve"][8.6][t], p99["coserve"][16.7][t]]
            assert list(lines["samba"].get_xdata()) == [8.6]
            target = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
            assert len(target) == 1 and list(target[0].get_ydata()) == [2.0, 2.0]
        assert {t.get_text() for t in fig.legends[0].get_texts()} == {"coserve", "samba"}
    finally:
        plt.close(fig)


# -- the demo's first minutes (an audit of the new-engineer path) ---------------------------------------------------
def _demo_cfg(tmp_path, store):
    from coe import parse_spec

    return load_config(write_line(tmp_path / "line", store=store), env={}), parse_spec(TINY_SPEC)


def test_a_second_demo_on_the_same_data_dir_is_refused_before_it_touches_the_first_ones_files(tmp_path):
    """It deleted the first demo's live database (its agent lock inside it) and both ran.  (Only the writable
    checks, which make the store and data directories if missing, run before the lock.)"""
    from coe import CoEError
    from edge_agent.demo import demo_lock, run_demo

    cfg, model = _demo_cfg(tmp_path, tmp_path / "experts")
    first = demo_lock(cfg)
    try:
        demo_db_path(cfg).parent.mkdir(parents=True)
        demo_db_path(cfg).write_bytes(b"the first demo's database")
        with pytest.raises(CoEError, match="another 'coe-agent demo' runs on"):
            run_demo(cfg, model, frames=5, quiet=True)
        assert demo_db_path(cfg).read_bytes() == b"the first demo's database"
    finally:
        first.release()
    demo_lock(cfg).release()                       # free again once the first has ended


def test_the_demo_checks_its_store_and_recording_before_minutes_of_training(tmp_path):
    from coe import CoEError
    from edge_agent.demo import run_demo
    from storage.recording import RecordingError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg, model = _demo_cfg(tmp_path, blocker / "experts")
    with pytest.raises(CoEError, match=r"the expert store .*a-file/experts is not writable: Not a directory"):
        run_demo(cfg, model, frames=5, quiet=True)
    cfg, model = _demo_cfg(tmp_path, tmp_path / "experts")
    empty = tmp_path / "no-recording"
    empty.mkdir()
    with pytest.raises(RecordingError):
        run_demo(cfg, model, frames=5, quiet=True, recording=empty)
    assert not (tmp_path / "experts").exists()     # nothing trained or built before the refusal
    res = CliRunner().invoke(cli, ["demo", "--config", str(tmp_path / "line" / "line-T.yaml"), "--frames", "0"])
    assert res.exit_code == 2 and "--frames" in res.output


def test_training_progress_is_plain_lines_where_stderr_is_no_terminal(capsys):
    """tqdm draws nothing without a terminal: a first demo under `| tee` or CI printed nothing for minutes."""
    from edge_agent.progress import step_bars

    with step_bars() as tick:
        for step in range(1, 4):
            tick("resnet18", step, 3)
    err = capsys.readouterr().err
    assert "training resnet18: step 1 of 3" in err and "training resnet18: done" in err
    assert "step 2 of 3" not in err                 # at most one line per PLAIN_EVERY_S between start and end
