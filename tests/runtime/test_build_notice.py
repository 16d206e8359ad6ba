"""One log line before a JIT build that will really compile: none when a build is cached or loaded."""
from __future__ import annotations

import logging

from ds_pipemorph.staging import builder as b
from ds_pipemorph.staging.builder import StagingRingBuilder, announce_build, extension_dir, needs_build


def test_a_cold_cache_is_announced_once_and_a_cached_build_is_not(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(b, "_announced", set())
    ring = StagingRingBuilder(name="pipemorph_notice_probe")
    assert extension_dir(ring.name) == tmp_path / "pipemorph_notice_probe"  # torch's rule with the variable set
    with caplog.at_level(logging.WARNING, logger="ds_pipemorph"):
        assert announce_build(ring, "the probe op") and announce_build(ring, "the probe op")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"pipemorph: building the probe op in {tmp_path / 'pipemorph_notice_probe'} (first start only, "
                     f"this takes a while; later starts load it)"]
    (tmp_path / "pipemorph_notice_probe").mkdir()
    (tmp_path / "pipemorph_notice_probe" / "pipemorph_notice_probe.so").write_bytes(b"")
    assert not needs_build(ring)


def test_only_rank_0_says_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(b, "_announced", set())
    with caplog.at_level(logging.WARNING, logger="ds_pipemorph"):
        assert announce_build(StagingRingBuilder(name="pipemorph_notice_probe"), "the probe op")
    assert caplog.records == []
