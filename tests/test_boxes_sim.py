"""Several boxes in the simulated device and the cost model (issue 15, part 5): per-box compute, SSD and host
tier, the link's transfer in the scheduler's costs, the lower bound, and scaling on the GPU-class profile."""
from __future__ import annotations

import re

import pytest

from coe.workload import make_workload, task
from executors.costs import ExecutorInfo, ProfileCosts
from executors.links import Link, Links
from executors.profile import DeviceProfile, Profile
from executors.simdevice import SimExecutor, SimSystem, lower_bound, simulate
from executors.systems import build_system
from storage.policies import make_policy
from storage.pool import Pool
from test_simdevice import GPU_CLASS, one_arch_model, spans, toy_profile, toy_workload

FRAME = 1000
# 0.5 s of link time per frame, 0.25 s one way: large enough to read off a span
SLOW = Link(FRAME / 0.5, 0.25, "test: slow link")


def gpu_profile(load: float = 0.0):
    dev = DeviceProfile("cuda:0", "cuda", 10_000, executors=1, concurrency=(1.0, 1.0))
    return toy_profile({"cuda:0": dev}, {"cuda": (1.0, 0.0, 4)}, load=load)


def two_boxes(init: str = "warm", **kw) -> SimSystem:
    execs = (SimExecutor("a", "cuda:0", 5000, 4000, box=0), SimExecutor("b", "cuda:0", 5000, 4000, box=1))
    return SimSystem("t", execs, "coserve-paper", "coserve", init=init, boxes=2, link=SLOW, frame_bytes=FRAME, **kw)


def test_executors_on_two_boxes_do_not_share_a_gpu():
    """Same device name, different boxes: each GPU computes alone (on one box the two would share it)."""
    model = one_arch_model(2)
    prof = gpu_profile()
    one_box = SimSystem("t", (SimExecutor("a", "cuda:0", 5000, 4000), SimExecutor("b", "cuda:0", 5000, 4000)),
                        "coserve-paper", "coserve")
    shared = simulate(toy_workload(model, ["c0", "c1"]), prof, one_box, record_order=True)
    assert spans(shared) == pytest.approx({"e0": 2.0, "e1": 2.0})    # c(2) = 1: each at half speed
    apart = simulate(toy_workload(model, ["c0", "c1"]), prof, two_boxes(), record_order=True)
    got = {ex: (end - start) for ex, _, _, start, end in apart.order}
    assert got["a"] == pytest.approx(1.0)                           # the front box: no link
    assert got["b"] == pytest.approx(0.5 + 0.25 + 1.0)              # the frame crosses the link first


def test_batches_to_one_box_queue_for_its_link():
    """Two boxes past the front one each have a link; a batch of 2 frames holds its link for 2 x 0.5 s."""
    model = one_arch_model(3)
    execs = (SimExecutor("a", "cuda:0", 5000, 4000, box=0), SimExecutor("b", "cuda:0", 5000, 4000, box=1))
    system = SimSystem("t", execs, "coserve-paper", "coserve", boxes=2, link=SLOW, frame_bytes=FRAME)
    # warm init round-robin: e0 -> a, e1 -> b, e2 -> a; two frames of e1 go to b as one batch
    rep = simulate(toy_workload(model, ["c1", "c1"]), gpu_profile(load=10.0), system, record_order=True)
    (ex, expert, frames, start, end), = rep.order
    assert (ex, expert, len(frames)) == ("b", "e1", 2)
    assert end - start == pytest.approx(2 * 0.5 + 0.25 + 2 * 1.0)


def test_each_box_reads_its_own_ssd():
    """Cold loads on two boxes overlap; two executors of one box queue for its one SSD."""
    model = one_arch_model(2)
    prof = gpu_profile(load=3.0)
    fast = Link(1e12, 0.0, "test: free link")
    apart = SimSystem("t", (SimExecutor("a", "cuda:0", 5000, 1000, box=0), SimExecutor("b", "cuda:0", 5000, 1000,
                                                                                         box=1)),
                      "coserve-paper", "coserve", init="cold", boxes=2, link=fast, frame_bytes=FRAME)
    together = SimSystem("t", (SimExecutor("a", "cuda:0", 5000, 1000), SimExecutor("b", "cuda:0", 5000, 1000)),
                         "coserve-paper", "coserve", init="cold")
    dev2 = DeviceProfile("cuda:0", "cuda", 10_000, executors=2, concurrency=(1.0, 2.0))
    prof2 = toy_profile({"cuda:0": dev2}, {"cuda": (1.0, 0.0, 4)}, load=3.0)
    assert simulate(toy_workload(model, ["c0", "c1"]), prof, apart).makespan == pytest.approx(3.0 + 1.0)
    assert simulate(toy_workload(model, ["c0", "c1"]), prof2, together).makespan == pytest.approx(6.0 + 1.0)


def test_the_cost_model_charges_the_link_per_frame_and_per_batch():
    model = one_arch_model(1)
    prof = gpu_profile()
    pool = Pool("cuda", 4000, make_policy("coserve"), None)
    infos = {"local": ExecutorInfo("cuda", 5000, pool, device="cuda:0"),
             "remote": ExecutorInfo("cuda", 5000, pool, device="cuda:0", node="box-2", link=SLOW, ssd_channel="box-2")}
    costs = ProfileCosts(model, infos, prof, frame_bytes=FRAME)
    assert costs.exec_cost("local", "e0") == pytest.approx((1.0, 0.0))
    assert costs.exec_cost("remote", "e0") == pytest.approx((1.5, 0.25))
    assert costs.ssd_channel("remote") == "box-2" and costs.ssd_channel("local") == ""


def test_a_system_on_boxes_needs_a_link_and_valid_boxes():
    ex = SimExecutor("a", "cuda:0", 5000, 4000, box=1)
    with pytest.raises(ValueError, match="outside 0..0"):
        SimSystem("t", (ex,), "coserve", "coserve")
    with pytest.raises(ValueError, match="need a link"):
        SimSystem("t", (ex,), "coserve", "coserve", boxes=2)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0, 0.001)


def test_links_round_trip_and_a_bad_file_is_named(tmp_path):
    links = Links({"box-2": Link(1.2e9, 0.0002, "measured")}, frame_bytes=20_000, source="test")
    back = Links.load(links.save(tmp_path / "links.json"))
    assert back.get("box-2") == links.get("box-2") and back.frame_bytes == 20_000 and back.get("box-3") is None
    (tmp_path / "bad.json").write_text('{"links": {"box-2": {"bandwidth_bps": -1, "latency_s": 0}}}')
    with pytest.raises(Exception, match="bad.json: malformed link profile"):
        Links.load(tmp_path / "bad.json")
    from coe import CoEError

    for text, says in (("[]", "expected an object with a 'links' object"),
                       ('{"links": []}', "expected an object with a 'links' object"),
                       ('{"links": {"box-2": {"bandwidth_bps": 1e9, "latency_s": "slow"}}}', "could not convert"),
                       ('{"links": {"box-2": {"bandwidth_bps": Infinity, "latency_s": 0}}}', "links.box-2"),
                       ('{"links": {}, "frame_bytes": "big"}', "frame_bytes: must be a positive integer"),
                       ('{"links": {"box-2": {"latency_s": 0}}}', "bandwidth_bps")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(CoEError, match=f"bad.json: malformed link profile: .*{re.escape(says)}"):
            Links.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_bytes(b'{"source": "caf\xe9"}')
    with pytest.raises(CoEError, match="bad.json: malformed link profile"):
        Links.load(tmp_path / "bad.json")


@pytest.mark.parametrize("boxes", [2, 3])
def test_the_lower_bound_holds_on_several_boxes(boxes):
    prof = Profile.load(GPU_CLASS)
    link = Link.ethernet(10, 0.1)
    for seed in range(3):
        w = make_workload(task("A1", requests=200, types=60, seed=seed, interval=0.001))
        system = build_system("coserve", prof, boxes=boxes, link=link)
        rep = simulate(w, prof, system)
        assert rep.frames == 200 and rep.lower_bound <= rep.makespan + 1e-9
        # cold pools: every used expert is read from some box's SSD, and the bound stays below the schedule
        cold = simulate(w, prof, build_system("coserve", prof, boxes=boxes, link=link, init="cold"))
        assert lower_bound(w, prof, system, set()) <= cold.makespan + 1e-9


@pytest.mark.parametrize("wl", ["A1", "A2", "B1", "B2"])
def test_a_2000_type_board_scales_over_boxes_and_switches_per_frame_stay_near_the_floor(wl):
    """The issue's targets on the GPU-class profile, simulated in the documented configuration: 2,000 types on
    2,000 placements (every type appears), cold pools, each task.  >= 1.8x on 2 boxes and >= 3.4x on 4.

    Switches: measured on seeds 0..4 of all four tasks (docs/cluster.md), CoServe's switches on 1, 2 and 4 boxes
    stayed within 2.8% of the floor (every expert the frames use loaded once; the hard lower bound) and within
    2.5% of one box's; since a prefetch reads when its batch computes, as the agent's does (docs/scheduling.md),
    within 3.4% and 3.0%.  Without the scheduler's work terms ('-work') the worst box count of every task and
    seed was 5.7-12% above the floor, so the 3.5% bound on the floor is what tells the two apart; the bound on
    one box's keeps the rise with boxes small.  One seed (0) here: ~3 s a task."""
    from edge_agent.bench import run_boxes

    prof = Profile.load(GPU_CLASS)
    rows = run_boxes([wl], prof, [1, 2, 4], ["coserve"], Link.ethernet(10, 0.1),
                     overrides={"types": 2000, "board_size": 2000}, init="cold")[wl]
    by = {r["boxes"]: r for r in rows}
    assert by[2]["speedup"] >= 1.8 and by[4]["speedup"] >= 3.4
    for n in (1, 2, 4):
        assert by[n]["floor"] == by[1]["floor"] > 0                            # the same frames, the same floor
        assert by[n]["switches"] <= 1.035 * by[n]["floor"], (n, by[n]["switches"], by[n]["floor"])
        assert by[n]["switches_per_frame"] <= 1.03 * by[1]["switches_per_frame"], \
            (n, by[n]["switches_per_frame"], by[1]["switches_per_frame"])
    assert all(r["lower_bound"] <= r["makespan"] + 1e-9 for r in rows)


def test_bench_cli_runs_boxes_and_refuses_a_bad_count():
    import json

    from click.testing import CliRunner

    from edge_agent.cli import cli as main

    bad = CliRunner().invoke(main, ["bench", "--sim", "--boxes", "1,0"])
    assert bad.exit_code != 0 and "each box count must be >= 1" in bad.output
    ok = CliRunner().invoke(main, ["bench", "--sim", "--boxes", "1,2", "--types", "60", "--board-size", "90",
                                   "--requests", "150", "-w", "A1", "--json"])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.output.strip().splitlines()[-1])
    assert doc["mode"] == "sim" and [r["boxes"] for r in doc["tasks"]["A1"]] == [1, 2]
    assert doc["overrides"] == {"types": 60, "board_size": 90, "requests": 150}


def test_a_retired_executor_hands_back_its_queue_and_gets_nothing_until_restored():
    """What a lost remote executor does (executors/remote.py): its queued requests go back to the others."""
    from coe import Frame, Request
    from executors.scheduler import FixedCosts, Scheduler

    s = Scheduler(["a", "b"], "coserve", costs=FixedCosts(resident=lambda n: {"x"} if n == "b" else set()))
    reqs = [Request(Frame(f"f{i}", "A", "B", "C", 0.0, None), "x") for i in range(3)]
    assert {s.submit(r) for r in reqs} == {"b"}                  # x is resident on b: its queue takes them
    back = s.retire("b")
    assert [r.frame.frame_id for r in back] == ["f0", "f1", "f2"] and s.active() == ["a"]
    assert s.queued_experts("b") == [] and s.depth() == 0
    assert {s.submit(r) for r in back} == {"a"}                  # resubmitted: only the executor left
    s.restore("b")
    assert s.active() == ["a", "b"]
    while (batch := s.next_batch("a", timeout=0)) is not None:     # a serves what it was handed
        s.finished(batch)
    assert s.depth() == 0
    # x is still resident on b alone: a restored b takes it again (one left out of assignment would not)
    assert s.submit(Request(Frame("f9", "A", "B", "C", 0.0, None), "x")) == "b"


def test_a_request_lost_max_lost_times_is_given_up_not_requeued():
    """A batch lost with its executor counts one attempt per request; at `max_lost` requeue hands it back."""
    from coe import Frame, Request
    from executors.scheduler import FixedCosts, Scheduler

    s = Scheduler(["a", "b"], "coserve", costs=FixedCosts(), max_lost=2)
    poison, good = (Request(Frame(f, "A", "B", "C", 0.0, None), "x") for f in ("p", "g"))
    s.submit(poison)
    for attempt in (1, 2):
        b = next(s.next_batch(n, timeout=0) for n in s.active() if s.queued_experts(n))
        assert b.requests == [poison]
        s.finished(b, lost=True)
        assert s.lost_attempts(poison) == attempt
        gone = s.requeue(b.requests)
        assert gone == ([] if attempt == 1 else [poison])
    assert s.given_up == 1 and s.depth() == 0 and s.lost_attempts(poison) == 0
    # a batch that ran clears its requests' count: a later loss starts again at 1
    s.submit(good)
    b = next(s.next_batch(n, timeout=0) for n in s.active() if s.queued_experts(n))
    s.finished(b, lost=True)
    assert s.requeue(b.requests) == [] and s.lost_attempts(good) == 1
    b = next(s.next_batch(n, timeout=0) for n in s.active() if s.queued_experts(n))
    s.finished(b)
    assert s.lost_attempts(good) == 0
    with pytest.raises(ValueError, match="max_lost must be >= 1"):
        Scheduler(["a"], max_lost=0)


def test_local_device_maps_the_configured_gpu_through_what_ray_assigned():
    """CUDA_VISIBLE_DEVICES as a Ray worker would have it (a fake env: no GPU needed)."""
    from coe import CoEError
    from executors.remote import local_device

    assert local_device("cuda:1", "1", ["1"]) == "cuda:0"            # Ray narrowed the view to GPU 1
    assert local_device("cuda:3", "1,3", ["1", "3"]) == "cuda:1"
    assert local_device("cuda", "0,1", ["0", "1"]) == "cuda:0"       # 'cuda' is GPU 0
    with pytest.raises(CoEError, match=r"cuda:1: Ray gave this actor GPU\(s\) 0 only"):
        local_device("cuda:1", "0", ["0"])
    assert local_device("cuda:1", None, ["0"]) == "cuda:1"           # Ray told not to narrow: the node's numbering
    assert local_device("cuda:1", "2,3", ["0"]) == "cuda:1"          # the operator's set: torch numbers it so
    assert local_device("cuda:1", "1", []) == "cuda:1"               # not a Ray worker
    assert local_device("cpu", "0", ["0"]) == "cpu"
