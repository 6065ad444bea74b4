"""The offline searches (CoServe §4.4): the decay-window search, the activation reserve, the two split rules,
and the executor-count search on the simulator."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from coe.workload import make_workload, task
from executors.profile import DeviceProfile, Profile, decay_window_search, stop_reason
from executors.tuning import (NOTE_PREFIX, WEAK_RULE_SHARE, activation_reserve, expert_cap, plan_count, tune,
                              weak_rule)

GPU_CLASS = Path(__file__).resolve().parents[1] / "configs" / "profiles" / "gpu-class.json"
GB = 1_000_000_000


def recorded(f):
    """`f` as a throughput callback that records every n it is asked for."""
    calls: list[int] = []

    def throughput(n: int) -> float:
        calls.append(n)
        return f(n)
    return throughput, calls


# -- decay_window_search -----------------------------------------------------------------

def test_window_slides_by_the_decay_factor():
    # Eq. 1: window 15 -> sizes 15, 12.75, 10.84, 9.21, ... (rounded upper bounds)
    tp, calls = recorded(lambda n: float(n))   # a straight line never deviates from its own fit
    low, high, pts = decay_window_search(tp, 70)
    assert [n for n, _ in pts] == [15, 28, 39, 48, 56, 63, 69, 70] == calls
    assert (low, high) == (69, 70)
    assert stop_reason(pts) == ""              # it reached n_max on the trend


def test_sharp_drop_stops_on_the_first_sample_past_it():
    tp, calls = recorded(lambda n: float(n) if n <= 40 else 0.3 * n)
    low, high, pts = decay_window_search(tp, 300)
    assert (low, high) == (39, 48) and calls == [15, 28, 39, 48]
    assert low < 40 <= high
    assert stop_reason(pts) == "Eq. 3"


@pytest.mark.parametrize("plateau", [45, 60, 100])
def test_linear_rise_then_plateau_stops_where_eq3_says(plateau):
    # The fit of the first three points is y = n exactly, so Eq. 3 trips at the first sample with
    # (n - plateau) / n > 5%, i.e. n > plateau / 0.95, and not one sample later.
    tp, calls = recorded(lambda n: float(min(n, plateau)))
    low, high, pts = decay_window_search(tp, 400)
    first_over = next(n for n in calls if n > plateau / 0.95)
    assert high == first_over == calls[-1]
    assert all(n <= plateau / 0.95 for n in calls[:-1])
    assert stop_reason(pts) == "Eq. 3"


def test_concave_rise_then_plateau_stops_soon_not_at_n_max():
    # Diminishing returns and then flat (what a capped expert memory looks like): refitting on every point
    # bends the line along with the curve and walks to n = 160 in 82 samples; the fit of the first three
    # points trips Eq. 3 on the fifth sample.
    tp, calls = recorded(lambda n: 10 * math.sqrt(min(n, 150)))
    low, high, pts = decay_window_search(tp, 400)
    assert (low, high) == (48, 56) and len(calls) == 5
    assert stop_reason(pts) == "Eq. 3"


def test_the_fit_uses_only_the_first_n_points():
    # sqrt(n): the stop is worked out here from the fit of the first three samples, and a refit on all the
    # samples so far is checked to stay within the margin there, so only a first-N fit passes.
    f = lambda n: math.sqrt(n)  # noqa: E731
    xs = [15, 28, 39]
    k, b = _lstsq([(x, f(x)) for x in xs])
    # first sample after the fit where Eq. 3 trips with the first-three fit
    expected_stop = next(n for n in (48, 56, 63, 69, 74, 78) if (k * n + b - f(n)) / (k * n + b) > 0.05)
    # a refit on all points so far would not trip there: its prediction at that n is within the margin
    seen = [(x, f(x)) for x in (15, 28, 39, 48, 56, 63, 69, 74, 78) if x < expected_stop]
    k_all, b_all = _lstsq(seen)
    assert (k_all * expected_stop + b_all - f(expected_stop)) / (k_all * expected_stop + b_all) <= 0.05
    tp, calls = recorded(f)
    low, high, pts = decay_window_search(tp, 300)
    assert high == expected_stop == calls[-1]


def test_slow_decline_after_a_rise_stops_once_the_gap_passes_the_margin():
    # rises on the first three samples, then loses 1% per further expert: at 48 it is 9% below the peak and
    # 26% below the trend
    tp, calls = recorded(lambda n: float(n) if n <= 39 else 39 * (1 - 0.01 * (n - 39)))
    low, high, pts = decay_window_search(tp, 300)
    assert (low, high) == (39, 48) and len(calls) == 4


def test_slow_decline_from_the_start_stops_after_the_fit():
    # no upward trend to follow: a flat-or-falling fit would be followed to n_max (222 samples here)
    tp, calls = recorded(lambda n: 100 - 0.1 * n)
    low, high, pts = decay_window_search(tp, 300)
    assert calls == [15, 28, 39] and (low, high) == (28, 39)
    assert stop_reason(pts) == "no upward trend"


def test_search_parameters_are_checked():
    with pytest.raises(ValueError, match="n_max"):
        decay_window_search(float, 0)
    with pytest.raises(ValueError, match="fit_points"):
        decay_window_search(float, 50, fit_points=1)


def _lstsq(points):
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    k = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return k, my - k * mx


# -- reserve, rules, cap -----------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_class() -> Profile:
    return Profile.load(GPU_CLASS)


@pytest.fixture(scope="module")
def board_a():
    return make_workload(task("A1", requests=300)).model


def reserve_of(profile: Profile, model, kind: str) -> int:
    """Max over the model's archs on `kind` of activation bytes x max batch, worked out here independently."""
    return max(profile.arch(a, kind).activation_bytes * profile.arch(a, kind).max_batch
               for a in {e.arch for e in model.experts.values()})


def test_activation_reserve_is_the_biggest_max_batch(gpu_class, board_a):
    reserve, by = activation_reserve(gpu_class, board_a, "cuda")
    assert reserve == reserve_of(gpu_class, board_a, "cuda") == 136_000_000 * 16   # yolov8l at batch 16
    assert by == "ultralytics/yolov8l at batch 16"
    assert activation_reserve(gpu_class, board_a, "cpu")[0] == 136_000_000 * 4


def test_weak_rule_threshold():
    dev = DeviceProfile("cpu", "cpu", 4 * GB)
    assert weak_rule(dev, 1, GB) and weak_rule(dev, 2, GB // 2)             # exactly 25%: weak
    assert not weak_rule(dev, 1, GB + 1) and not weak_rule(dev, 3, GB // 2)  # above: search
    assert WEAK_RULE_SHARE == 0.25
    assert expert_cap(dev, 3, GB // 2) == 3 * (4 * GB // 3 - GB // 2)


def test_split_search_never_samples_past_the_cap_and_ends_there():
    # A throughput that always rises with expert memory: the search must walk to the cap's expert count
    # and stop, with every sample under the cap and no repeated (capped) samples.
    dev = DeviceProfile("cuda:0", "cuda", 12 * GB)
    sizes = [170_500_000] * 300
    reserve = 2 * GB
    seen: list[tuple[int, int]] = []

    def run(executors: int, expert_memory: int) -> float:
        seen.append((executors, expert_memory))
        return expert_memory / 1e8

    plan = plan_count(run, dev, 2, reserve, sizes)
    cap = expert_cap(dev, 2, reserve)
    assert plan.rule == "search" and plan.cap == cap == 8 * GB
    n_cap = cap // 170_500_000                         # 46 experts fit the cap
    assert plan.n_max == n_cap and plan.stopped == "cap"
    assert [n for n, _ in plan.points] == [15, 28, 39, n_cap]
    mems = [m for _, m in seen]
    assert all(m <= cap for m in mems) and mems[:4] == sorted(set(mems[:4]))
    assert plan.experts == n_cap and plan.expert_memory == n_cap * 170_500_000 <= cap


def test_infeasible_counts_are_skipped_with_the_reason():
    dev = DeviceProfile("cpu", "cpu", 1_600_000_000)
    sizes = [175_000_000] + [100_000_000] * 20
    reserve = 544_000_000
    run = lambda executors, expert_memory: 1.0 + executors  # noqa: E731
    # 2 executors: 0.80 GB each >= 0.175 + 0.544; 3: 0.53 GB each < 0.72 GB (but > the expert alone)
    assert plan_count(run, dev, 2, reserve, sizes).rule != "infeasible"
    bad = plan_count(run, dev, 3, reserve, sizes)
    assert bad.rule == "infeasible" and bad.throughput == 0.0
    assert "largest expert (0.17 GB) plus the activation reserve (0.54 GB)" in bad.reason


# -- tune() on the simulator -------------------------------------------------------------

@pytest.fixture(scope="module")
def tuned(gpu_class, board_a) -> Profile:
    return tune(gpu_class, board_a, requests=300)


def test_tune_on_gpu_class_keeps_the_activation_reserve(tuned, gpu_class, board_a):
    out = tuned
    sizes = sorted((e.nbytes for e in board_a.experts.values()), reverse=True)
    probs = board_a.usage_probabilities()
    by_use = [board_a.experts[e].nbytes for e in sorted(board_a.experts, key=lambda e: (-probs[e], e))]
    joint = [x for x in out.notes if x.startswith(f"{NOTE_PREFIX}joint count search")]
    assert len(joint) == 1
    for name, dev in out.devices.items():
        reserve = reserve_of(gpu_class, board_a, dev.kind)
        n = dev.executors
        assert 1 <= n <= 4
        assert dev.expert_memory <= dev.memory - n * reserve            # activations for the max batch stay free
        assert dev.expert_memory >= n * sizes[0]                         # each pool holds the largest expert
        assert len(dev.count_points) == 4                                # the device searched alone, 1..4
        for k, _ in dev.split_points:                                    # no sample past the cap
            assert sum(by_use[:k]) <= dev.memory - n * reserve
        notes = [x for x in out.notes if x.startswith(f"{NOTE_PREFIX}{name}:")]
        assert len(notes) == 1
        assert f"{name} {n} executor(s) with {dev.expert_memory / GB:.2f} GB" in joint[0]
    # the joint search keeps the best combination it tried
    tried = [float(x.split(": ")[1].rstrip("/s")) for x in joint[0].split("tried ")[1].split(", ")]
    chosen = float(joint[0].split(" of experts (")[1].split("/s)")[0])
    assert chosen == max(tried) and len(tried) == 16


def test_tune_replaces_its_own_notes_on_a_rerun(tuned, board_a):
    out = tuned
    again = tune(out, board_a, requests=300, max_executors=1)
    mine = [n for n in again.notes if n.startswith(NOTE_PREFIX)]
    assert len(mine) == 4 and sum("best simulated throughput of 1..1," in n for n in mine) == 1  # 2 devices, joint, summary
    assert [n for n in again.notes if not n.startswith(NOTE_PREFIX)] == \
        [n for n in out.notes if not n.startswith(NOTE_PREFIX)]


def only(profile: Profile, name: str, **changes) -> Profile:
    return replace(profile, devices={name: replace(profile.devices[name], **changes)})


def test_weak_rule_where_the_reserve_is_small_search_where_it_is_large(gpu_class, board_a):
    reserve = reserve_of(gpu_class, board_a, "cuda")           # 2.18 GB
    weak = tune(only(gpu_class, "cuda:0", memory=12 * GB), board_a, requests=300, max_executors=1)
    dev = weak.devices["cuda:0"]                               # 18% of 12 GB
    assert dev.expert_memory == 12 * GB - reserve and dev.split_points == ()
    assert any("cuda:0: weak-processor rule" in n and "18%" in n for n in weak.notes)

    strong = tune(only(gpu_class, "cuda:0", memory=6 * GB), board_a, requests=300, max_executors=1)
    dev = strong.devices["cuda:0"]                             # 36% of 6 GB
    assert len(dev.split_points) >= 1 and dev.expert_memory <= 6 * GB - reserve
    assert any("cuda:0: memory-split search" in n and "36%" in n for n in strong.notes)


def test_tune_skips_infeasible_counts(gpu_class, board_a):
    # CPU with 1.6 GB: 1 and 2 executors fit the largest expert plus yolov8l's batch-4 reserve, 3 and 4 do not
    out = tune(only(gpu_class, "cpu", memory=1_600_000_000), board_a, requests=300)
    dev = out.devices["cpu"]
    assert [p[0] for p in dev.count_points] == [1, 2, 3, 4]
    assert dev.count_points[2][1] == 0.0 and dev.count_points[3][1] == 0.0
    assert dev.count_points[0][1] > 0 and dev.count_points[1][1] > 0
    # the better of the two feasible counts, the fewer executors on a tie (not the first feasible, not the worse)
    assert dev.executors == max(dev.count_points[:2], key=lambda p: (p[1], -p[0]))[0]
    note = next(n for n in out.notes if n.startswith(f"{NOTE_PREFIX}cpu:"))
    assert "3: infeasible" in note and "4: infeasible" in note and "activation reserve" in note


def test_no_feasible_count_leaves_the_device_alone(gpu_class, board_a):
    src = only(gpu_class, "cpu", memory=600_000_000)           # < 0.175 GB expert + 0.544 GB reserve
    out = tune(src, board_a, requests=300)
    assert out.devices["cpu"] == src.devices["cpu"]
    assert any(n.startswith(f"{NOTE_PREFIX}cpu: no executor count fits") for n in out.notes)


def test_count_search_takes_its_speedup_from_the_concurrency_curve(gpu_class, board_a):
    # tune must not scale K, B itself: the simulator shares the device by its curve.  With a curve that
    # scales perfectly, each CPU executor keeps its full profiled speed, so more executors must win; with
    # a flat curve they only split one executor's compute.
    base = only(gpu_class, "cpu", memory=16 * GB, profiled_executors=1)
    perfect = tune(only(base, "cpu", concurrency=(1.0, 2.0, 3.0, 4.0)), board_a, requests=300)
    flat = tune(only(base, "cpu", concurrency=(1.0,)), board_a, requests=300)
    p, f = dict(perfect.devices["cpu"].count_points), dict(flat.devices["cpu"].count_points)
    assert p[4] > 1.5 * p[1] and perfect.devices["cpu"].executors >= 3
    assert f[4] < 1.2 * f[1]


def test_the_searches_simulate_host_reads_as_the_line_sets_them(gpu_class, board_a, monkeypatch):
    """The searches simulate the levers the agent will run: CPU host reads, read-ahead and the CPU victims
    moving down, as the line's config sets them (no config: the agent's defaults)."""
    import types

    import executors.tuning as tuning

    seen = []
    real = tuning.simulate
    monkeypatch.setattr(tuning, "simulate", lambda w, p, system, **kw: seen.append(
        (system.cpu_host_reads, system.read_ahead, system.cpu_demote, system.cpu_demote_queued,
         system.victim_admission))
        or real(w, p, system, **kw))
    small = only(gpu_class, "cuda:0", memory=12 * GB)
    tune(small, board_a, types.SimpleNamespace(cpu_reads_host_tier=False), requests=100, max_executors=1)
    assert seen and all(s == (False, True, False, False, True) for s in seen)   # no host reads: no CPU victims
    seen.clear()
    tune(small, board_a, None, requests=100, max_executors=1)                 # no line config: the defaults
    assert seen and all(s == (True, True, False, True, True) for s in seen)
    seen.clear()
    tune(small, board_a, types.SimpleNamespace(ssd_read_ahead=False, cpu_victims_to_host_tier="always",
                                               host_tier_admission="all"), requests=100, max_executors=1)
    assert seen and all(s == (True, False, True, False, False) for s in seen)


def test_tune_refuses_a_model_without_expert_sizes(gpu_class, board_a):
    """A spec read from YAML has no sizes: every split would hold 0 bytes of experts (a GPU given 0 MB)."""
    unsized = replace(board_a, experts={k: replace(e, nbytes=0)
                                       for k, e in board_a.experts.items()})
    with pytest.raises(ValueError, match="need each expert's size"):
        tune(gpu_class, unsized)


@pytest.mark.parametrize("shape, n_cap, want", [
    # no upward trend from the start: the midpoint of the last window (33 experts) was below 15's sample
    ("decline", None, 15),
    # few experts fit (the cap is 25): two samples, no fit, and a measured drop: the cap was chosen anyway
    ("drop-at-cap", 25, 15),
])
def test_without_an_eq3_stop_the_split_is_the_best_point_measured(shape, n_cap, want):
    size = 170_500_000
    dev = DeviceProfile("cuda:0", "cuda", 12 * GB)
    reserve = 4 * GB                            # above a quarter of the device: the search rule, not the weak one
    cap = expert_cap(dev, 1, reserve)
    sizes = [size] * (n_cap if n_cap else 300)
    if n_cap:                                   # the cap in experts is the store's size here
        assert cap >= n_cap * size

    def run(executors: int, expert_memory: int) -> float:
        n = expert_memory // size
        return 100 - 0.1 * n if shape == "decline" else (100.0 if n <= 15 else 20.0)

    plan = plan_count(run, dev, 1, reserve, sizes)
    assert plan.rule == "search" and plan.experts == want, (plan.experts, plan.points, plan.stopped)
    assert plan.throughput == max(tp for _, tp in plan.points)


def test_a_floor_that_covers_the_first_windows_does_not_end_the_search_there():
    """Every pool holds the largest expert: one 2 GB expert on 4 executors puts the floor at 8 GB, which 15,
    28 and 39 small experts all fit under. Their samples were the floor's three times over ("no upward trend")
    and the split stayed at 8 GB though memory paid up to 20 GB."""
    dev = DeviceProfile("cuda:0", "cuda", 40 * GB)
    sizes = [2 * GB] + [20_000_000] * 400
    plan = plan_count(lambda ex, mem: round(min(mem, 20 * GB) / GB, 3), dev, 4, 3 * GB, sizes)
    assert plan.rule == "search" and plan.expert_memory > 8 * GB
    assert plan.throughput == max(tp for _, tp in plan.points) and len({tp for _, tp in plan.points[:3]}) == 3
