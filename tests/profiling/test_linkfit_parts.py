"""Pure parts of the profilers: sizes, the latency + size/bandwidth fit, links_ms, slow marks, merging."""
import pytest
import yaml

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.ir.profile import Profile
from ds_pipemorph.profiling.linkfit import fit_latency_bandwidth, link_delays, parse_sizes, slow_links
from ds_pipemorph.profiling.profileparts import load_base, merged


@pytest.mark.timeout(10)
def test_sizes_parse_with_binary_units_sorted_and_distinct():
    assert parse_sizes("16M,4K, 4096,1.5K,7") == [7, 1536, 4096, 16 * 1024**2]
    with pytest.raises(BadInput, match="'4X' is not a message size"):
        parse_sizes("4K,4X")


@pytest.mark.timeout(10)
def test_fit_recovers_latency_and_bandwidth_and_handles_flat_data():
    sizes = [4096 * 4**k for k in range(7)]
    times = [30.0 + s / 2e6 for s in sizes]  # 30 ms + 2 GB/s
    fit = fit_latency_bandwidth(sizes, times)
    assert fit.latency_ms == pytest.approx(30.0, rel=1e-6) and fit.bandwidth_gbps == pytest.approx(2.0, rel=1e-6)
    assert fit.time_ms(2_000_000) == pytest.approx(31.0)
    flat = fit_latency_bandwidth(sizes, [5.0, 5.1, 4.9, 5.0, 5.0, 4.8, 4.7])
    assert flat.bandwidth_gbps is None and flat.latency_ms == pytest.approx(5.0)
    pinned = fit_latency_bandwidth([1000, 1_000_000], [0.001, 1.0])  # would have a negative intercept
    assert pinned.latency_ms == 0.0 and pinned.bandwidth_gbps == pytest.approx(1.0, rel=1e-3)


@pytest.mark.timeout(10)
def test_links_ms_is_extra_over_the_fastest_link_or_absolute():
    assert link_delays([0.1, 0.08, 30.2], absolute=False) == [0.02, 0.0, 30.12]
    assert link_delays([0.1, 0.08, 30.2], absolute=True) == [0.1, 0.08, 30.2]


@pytest.mark.timeout(10)
def test_slow_marks_by_latency_or_bandwidth():
    marks = slow_links([0.1, 0.1, 30.0, 0.1], [4.0, 4.0, 4.0, 1.0], 2.0)
    assert marks[0] == marks[1] == ""
    assert marks[2].startswith("latency 300.0x") and marks[3].startswith("bandwidth 4.0x")


@pytest.mark.timeout(10)
def test_merge_keeps_other_keys_and_validates(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("stages: 3\nmicrobatches: 6\ncompute_ms: {forward: 1, backward_input: 1, backward_weight: 2}\n"
                 "links_ms: [0, 0]\nmemory: {max_inflight: [3, 2, 1]}\n")
    data = merged(load_base(str(p), 3, "this job"), 3, links_ms=[0.5, 30.0])
    assert list(data) == ["stages", "microbatches", "compute_ms", "links_ms", "memory"]
    assert data["compute_ms"]["backward_weight"] == 2 and Profile.model_validate(data).links_ms == [0.5, 30.0]
    assert merged(None, 3, links_ms=[0, 1]) == {"stages": 3, "links_ms": [0, 1]}
    with pytest.raises(BadInput, match="expected 2 values"):
        merged(None, 3, links_ms=[0, 1, 2])
    p.write_text(yaml.safe_dump({"stages": 3, "links_ms": [0, 0], "colour": "red"}))
    with pytest.raises(BadInput, match="unknown key 'colour'"):
        load_base(str(p), 3, "this job")
