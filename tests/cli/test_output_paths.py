"""Outputs: a path that cannot be written is refused before any work (one sentence naming it, exit
code 2, nothing left behind), Gantt pictures take their format from the suffix, and every command
says ``wrote PATH`` for each file it writes."""
import json

import pytest
import yaml

from cli_helpers import run, write
from ds_pipemorph.fileio import write_atomic

pytestmark = pytest.mark.timeout(120)

PROFILE = {
    "stages": 2,
    "microbatches": 4,
    "compute_ms": {"forward": 10, "backward_input": 10, "backward_weight": 10},
    "links_ms": [5],
}
LAYERS = {
    "stages": 2,
    "microbatches": 4,
    "layers": {"forward_ms": [2, 2, 3, 3], "backward_input_ms": 2, "backward_weight_ms": 1, "activation_mb": 8,
               "memory_mb": 100, "stash_mb": 8},
    "links": {"bandwidth_gbs": 10, "latency_ms": [1]},
    "memory": {"capacity_mb": 1000},
}
MATRIX = {"world_size": 4, "latency_ms": [[0 if a == b else 1 + (a + b) % 3 for b in range(4)] for a in range(4)]}


def inputs(tmp_path) -> dict:
    ins = tmp_path / "in"
    ins.mkdir()
    prof = write(ins, "profile.yaml", PROFILE)
    plan = ins / "plan.yaml"
    assert run("plan", prof, "-o", plan, "--greedy").exit_code == 0
    return {"profile": prof, "plan": plan, "layers": write(ins, "layers.yaml", LAYERS),
            "matrix": write(ins, "matrix.yaml", MATRIX), "report": write(ins, "report.sqlite", b"not read")}


# (command line with {OUT} for the output under test; the option named in the error)
COMMANDS = {
    "plan -o": (["plan", "{profile}", "-o", "{OUT}"], "--output"),
    "plan --gantt": (["plan", "{profile}", "--gantt", "{OUT}"], "--gantt"),
    "plan --chrome": (["plan", "{profile}", "--chrome", "{OUT}"], "--chrome"),
    "simulate --gantt": (["simulate", "{plan}", "--gantt", "{OUT}"], "--gantt"),
    "simulate --chrome": (["simulate", "{plan}", "--chrome", "{OUT}"], "--chrome"),
    "export -o": (["export", "{plan}", "-o", "{OUT}"], "--output"),
    "partition -o": (["partition", "{layers}", "-o", "{OUT}"], "--output"),
    "partition --plan": (["partition", "{layers}", "--plan", "{OUT}"], "--plan"),
    "place -o": (["place", "{matrix}", "--pp", "2", "--dp", "2", "-o", "{OUT}"], "--output"),
    "trace inspect --chrome": (["trace", "inspect", "{report}", "--chrome", "{OUT}"], "--chrome"),
    "trace inspect --gantt": (["trace", "inspect", "{report}", "--gantt", "{OUT}"], "--gantt"),
    # These launch jobs or time a model: the check fires first, so they end at once.
    "bench --out": (["bench", "--stages", "2", "--out", "{OUT}"], "--out"),
    "demo --out": (["demo", "--out", "{OUT}"], "--out"),
    "profile-links -o": (["profile-links", "-o", "{OUT}"], "--out"),
    "profile-links --report": (["profile-links", "--report", "{OUT}"], "--report"),
    "profile-links --merge": (["profile-links", "--merge", "{OUT}"], "--merge"),
    "profile-stages -o": (["profile-stages", "--model", "nowhere:model", "--input-shape", "2,4", "-o", "{OUT}"], "--out"),
    "profile-stages --merge": (["profile-stages", "--model", "nowhere:model", "--input-shape", "2,4", "--merge", "{OUT}"],
                               "--merge"),
}


def bad_path(tmp_path, kind: str, suffix: str):
    if kind == "directory":
        d = tmp_path / f"existing{suffix}"
        d.mkdir()
        return d
    if kind == "under a file":
        f = tmp_path / "plain.txt"
        f.write_text("a regular file")
        return f / f"out{suffix}"
    return f"/proc/pipemorph-out{suffix}"  # not creatable even for root


def tree(root):
    return sorted((str(p.relative_to(root)), p.is_dir()) for p in root.rglob("*"))


@pytest.mark.parametrize("kind", ["directory", "under a file", "unwritable"])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_an_unwritable_output_is_one_sentence_exit_2_and_nothing_is_left(tmp_path, monkeypatch, name, kind):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    ins = inputs(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args, option = COMMANDS[name]
    out = bad_path(work, kind, ".png" if "gantt" in name else ".json")
    before = tree(tmp_path)
    r = run(*[a.format(OUT=out, **ins) for a in args])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}: ") and str(out) in lines[0], r.stderr
    assert "Traceback" not in r.output
    assert tree(tmp_path) == before


@pytest.mark.parametrize("suffix,magic", [(".pdf", b"%PDF"), (".svg", b"<?xml"), (".png", b"\x89PNG")])
def test_gantt_format_follows_the_suffix(tmp_path, suffix, magic):
    prof = write(tmp_path, "p.yaml", PROFILE)
    pic = tmp_path / f"g{suffix}"
    r = run("plan", prof, "--greedy", "--gantt", pic)
    assert r.exit_code == 0, r.output
    assert pic.read_bytes().startswith(magic)


def test_a_gantt_suffix_matplotlib_cannot_write_is_refused_before_anything_is_written(tmp_path):
    prof = write(tmp_path, "p.yaml", PROFILE)
    r = run("plan", prof, "--greedy", "-o", tmp_path / "plan.yaml", "--gantt", tmp_path / "g.txt")
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--gantt" in lines[0] and "'.txt'" in lines[0] and ".pdf" in lines[0], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]


def test_two_options_naming_one_file_are_refused(tmp_path):
    prof = write(tmp_path, "p.yaml", PROFILE)
    r = run("plan", prof, "-o", tmp_path / "x.json", "--chrome", tmp_path / "x.json")
    assert r.exit_code == 2 and "--output and --chrome both name" in r.stderr
    assert not (tmp_path / "x.json").exists()


def wrote(r) -> list[str]:
    return [ln.removeprefix("wrote ") for ln in r.output.splitlines() if ln.startswith("wrote ")]


def test_every_file_written_is_announced(tmp_path):
    ins = inputs(tmp_path)
    o = tmp_path / "o"
    cases = [
        (["plan", ins["profile"], "--greedy", "-o", o / "plan.yaml", "--gantt", o / "plan.pdf", "--chrome", o / "plan.json"],
         ["plan.pdf", "plan.json", "plan.yaml"]),
        (["simulate", ins["plan"], "--gantt", o / "sim.svg", "--chrome", o / "sim.json"], ["sim.svg", "sim.json"]),
        (["export", ins["plan"], "-o", o / "torch.csv"], ["torch.csv"]),
        (["partition", ins["layers"], "-o", o / "parts.yaml", "--plan", o / "parts_plan.yaml"],
         ["parts.yaml", "parts_plan.yaml"]),
        (["place", ins["matrix"], "--pp", 2, "--dp", 2, "--search-evals", 100, "-o", o / "topo.yaml"], ["topo.yaml"]),
    ]
    for args, names in cases:
        r = run(*args)
        assert r.exit_code == 0, r.output
        said = [s.split(":")[0] for s in wrote(r)]  # export adds what it wrote after a colon
        assert sorted(said) == sorted(str(o / n) for n in names), (args[0], r.output)
        assert all((o / n).stat().st_size > 0 for n in names)


def test_with_json_the_wrote_lines_go_to_stderr_and_stdout_stays_json(tmp_path):
    prof = write(tmp_path, "p.yaml", PROFILE)
    out = tmp_path / "plan.yaml"
    r = run("plan", prof, "--greedy", "--json", "-o", out)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["stages"] == 2
    assert r.stderr.strip() == f"wrote {out}"
    assert yaml.safe_load(out.read_text())["stages"] == 2


def test_a_failed_write_removes_the_directories_it_made(tmp_path):
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "a" / "b" / "f.txt", 123)  # not text or bytes: fails after the mkdir
    assert list(tmp_path.iterdir()) == []
