"""Following a paired run's progress file while rank 0 appends to it."""
from ds_pipemorph.bench.launch import read_progress
from ds_pipemorph.bench.paired_launch import read_paired_progress


def test_a_half_written_last_line_is_ignored(tmp_path):
    path = tmp_path / "paired.progress"
    path.write_text("1 6 A\n2 6 B\n3 6")  # rank 0 is halfway through the third line
    assert read_paired_progress(path) == (2, 6, "B")
    path.write_text("1 6 A\n2 6 B\n3 6 A'\n")
    assert read_paired_progress(path) == (3, 6, "A'")


def test_no_file_or_no_complete_line_yet_is_no_progress(tmp_path):
    path = tmp_path / "paired.progress"
    assert read_paired_progress(path) is None
    path.write_text("1 6")
    assert read_paired_progress(path) is None


def test_the_bench_reader_also_skips_a_half_written_json_line(tmp_path):
    path = tmp_path / "bench.progress"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert read_progress(path) == {"step": 2}
