"""The straggler detector: acts within one iteration, ignores jitter, returns after recovery."""
import random

import pytest

from ds_pipemorph.control.detector import DetectorConfig, LinkDetector


def run(det, series, tolerance_of=lambda target: [10.0 + t for t in target]):
    """Feed per-iteration delays; re-plan instantly when asked; return (iteration, target) events."""
    det.adopt([0.0] * len(series[0]), tolerance_of([0.0] * len(series[0])))
    events = []
    for it, measured in enumerate(series):
        target = det.observe(measured)
        if target is not None:
            events.append((it, target))
            det.adopt(target, tolerance_of(target))
    return events


def test_delay_injected_at_iteration_5_is_acted_on_by_iteration_7():
    series = [[0.3, 0.2, 0.4]] * 5 + [[0.3, 0.2, 60.4]] * 10
    events = run(LinkDetector(3), series)
    assert events == [(6, [0.0, 0.0, 61.0])]  # decided after iteration 6 -> new plan in iteration 7


def test_a_single_slow_iteration_is_a_hiccup_not_a_straggler():
    series = [[0.3, 0.2, 0.4]] * 5 + [[0.3, 0.2, 60.4]] + [[0.3, 0.2, 0.4]] * 5
    assert run(LinkDetector(3), series) == []


def test_no_delay_means_no_replan_over_50_noisy_iterations():
    rng = random.Random(0)
    series = [[abs(rng.gauss(0.5, 0.6)) for _ in range(3)] for _ in range(50)]
    det = LinkDetector(3)
    assert run(det, series) == []
    assert det.replans == 0


def test_delay_within_the_plans_tolerance_is_absorbed_not_replanned():
    series = [[0.0, 9.0, 0.0]] * 10  # the plan tolerates 10 ms everywhere
    assert run(LinkDetector(3), series) == []


def test_recovered_link_returns_to_the_no_delay_plan_within_3_iterations():
    series = [[0.0, 0.0, 60.0]] * 5 + [[0.0, 0.0, 0.5]] * 6
    events = run(LinkDetector(3), series)
    assert events[0] == (1, [0.0, 0.0, 60.0])
    it, target = events[1]
    assert target == [0.0, 0.0, 0.0]
    assert it - 5 <= 2  # decided after the 2nd calm iteration -> plan in force by the 3rd


def test_jitter_around_a_planned_delay_does_not_flap():
    rng = random.Random(1)
    series = [[0.0, rng.gauss(30, 3), 0.0] for _ in range(40)]
    events = run(LinkDetector(3, DetectorConfig(quantum_ms=10.0)), series, lambda t: [x + 5.0 for x in t])
    assert len(events) <= 2  # the first estimate, perhaps one bump up; never down while the delay stays


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="recover_ratio"):
        DetectorConfig(recover_ratio=1.5)


def test_a_link_jittering_around_its_planned_delay_is_not_re_planned_but_a_slower_one_is():
    """Seen in the engine: 40.8 ms -> a plan for 41 that absorbs 41, then 41.6 ms re-planned for 42."""
    exact = lambda target: list(target)  # noqa: E731  (a plan absorbs exactly what it was made for)
    series = [[0.3, 0.2, 40.8]] * 2 + [[0.3, 0.2, 41.6], [0.3, 0.2, 42.9]] * 5
    assert run(LinkDetector(3), series, exact) == [(1, [0.0, 0.0, 41.0])]
    series += [[0.3, 0.2, 43.2]] * 2  # 5.4 % above the plan: a slower link
    assert run(LinkDetector(3), series, exact) == [(1, [0.0, 0.0, 41.0]), (13, [0.0, 0.0, 44.0])]
