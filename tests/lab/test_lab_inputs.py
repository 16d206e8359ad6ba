"""What a user writes for the lab (rates, rate traces, lab names) is read exactly or refused with one
sentence; these need no privilege."""
import subprocess
import sys
from pathlib import Path

import pytest

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.lab import Lab, format_rate, load_rate_trace, parse_rate


@pytest.mark.parametrize("text,bits", [("100mbit", 100_000_000), ("1.5gbit", 1_500_000_000),
                                       ("800kbit", 800_000), ("8000", 8000), ("40Mbit", 40_000_000)])
def test_rates_are_read_in_bits_per_second(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "100mb", "-5mbit", "100 MB/s", "7999"])
def test_a_rate_that_is_not_one_is_refused(text):
    with pytest.raises(BadInput, match="rate"):
        parse_rate(text)


def test_rates_print_in_the_largest_exact_unit():
    assert [format_rate(b) for b in (1_000_000_000, 1_500_000_000, 100_000_000, 12_345)] == \
        ["1gbit", "1500mbit", "100mbit", "12345bit"]


def test_a_rate_trace_is_read_and_checked(tmp_path):
    good = tmp_path / "trace.yaml"
    good.write_text("points:\n  - {t: 0, rate: 1gbit}\n  - {t: 2.5, rate: 100mbit}\n")
    tr = load_rate_trace(str(good))
    assert [(p.t, p.bits) for p in tr.points] == [(0.0, 1_000_000_000), (2.5, 100_000_000)]
    for text, words in (("points:\n  - {t: 3, rate: 1gbit}\n  - {t: 1, rate: 1gbit}\n", r"points: times must not decrease \(1 s comes after 3 s\)"),
                        ("points:\n  - {t: 0, rate: quick}\n", "rate 'quick'"),
                        ("points:\n  - {t: 0, rate: 1gbit, delay: 3}\n", "unknown key 'points.0.delay'"),
                        ("points: []\n", "points")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(BadInput, match=words):
            load_rate_trace(str(bad))


@pytest.mark.parametrize("kw,words", [({"lab_id": "Bad-Name"}, "lowercase"), ({"nodes": 0}, "1 to"),
                                      ({"networks": 3}, "networks")])
def test_a_lab_that_cannot_be_built_is_refused_before_anything_is_made(kw, words):
    with pytest.raises(BadInput, match=words):
        Lab(**kw)


BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "lab"
RATE_OPTION = {"lab_slow_link": "--rate", "lab_delegation": "--rate", "lab_orchestrator": "--rate",
               "lab_profile_links": "--rate", "lab_rate_trace": "--slow"}


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / f"{script}.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=BENCH.parents[1])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("script", [*RATE_OPTION, "lab_failover"])
def test_a_lab_benchmark_refuses_an_unwritable_out_in_one_sentence_before_any_lab(script, tmp_path):
    target = tmp_path / "a-file"
    target.write_text("x")
    r = _bench(script, "--out", str(target / "out.json"))  # under a regular file: nothing can be made there
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: --out:"), r.stderr
    assert target.read_text() == "x"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("script", list(RATE_OPTION))
def test_a_lab_benchmark_refuses_a_bad_rate_in_one_sentence(script, tmp_path):
    r = _bench(script, RATE_OPTION[script], "fast", "--out", str(tmp_path / "out.json"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "rate 'fast'" in r.stderr, r.stderr
    assert not (tmp_path / "out.json").exists()
