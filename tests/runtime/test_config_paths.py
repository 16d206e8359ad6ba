"""Relative paths of the ``pipemorph`` section are read against the config file's directory when
the config is a file, else against the working directory; the result is one absolute path."""
from __future__ import annotations

import base64
import json
import os

import pytest

from ds_pipemorph.runtime.config import PipeMorphConfigError, parse_config, resolve_paths
from ds_pipemorph.runtime.initialize import paths_base
from ds_pipemorph.runtime.plans import build_plan

EVERY_PATH = {"plan_file": "plans/p.yaml", "timeline": "out/t.json", "profile_out": "../m.yaml",
              "rebalance": {"layer_profile": "layers.yaml", "noise": 0.2},
              "orchestrate": {"matrix": "./links/matrix.yaml"},
              "inject": {"trace": "traces/a.yaml", "compute_trace": "c.yaml", "links": {"1": {"delay_ms": 3}}}}


def test_every_relative_path_is_joined_to_the_base_and_nothing_else_changes():
    got = resolve_paths(EVERY_PATH, "/jobs/gpt")
    assert got == {"plan_file": "/jobs/gpt/plans/p.yaml", "timeline": "/jobs/gpt/out/t.json",
                   "profile_out": "/jobs/m.yaml",
                   "rebalance": {"layer_profile": "/jobs/gpt/layers.yaml", "noise": 0.2},
                   "orchestrate": {"matrix": "/jobs/gpt/links/matrix.yaml"},
                   "inject": {"trace": "/jobs/gpt/traces/a.yaml", "compute_trace": "/jobs/gpt/c.yaml",
                              "links": {"1": {"delay_ms": 3}}}}
    assert EVERY_PATH["inject"]["trace"] == "traces/a.yaml"  # the caller's section is not changed


def test_absolute_home_and_non_path_values_are_kept_for_validation(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    section = {"plan_file": "/abs/p.yaml", "timeline": "~/t.json", "profile_out": "  ", "rebalance": None,
               "orchestrate": "not a mapping", "inject": {"trace": 7}}
    assert resolve_paths(section, "/base") == {**section, "timeline": "/home/someone/t.json"}
    assert resolve_paths(None, "/base") is None
    with pytest.raises(PipeMorphConfigError, match="profile_out must be a file path"):
        parse_config(resolve_paths({"profile_out": "  "}, "/base"))
    with pytest.raises(PipeMorphConfigError, match="inject.trace: expected a string, got the integer 7"):
        parse_config(resolve_paths({"inject": {"trace": 7}}, "/base"))


def test_the_base_is_the_config_files_directory_else_the_working_directory(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    path = conf / "ds_config.json"
    path.write_text(json.dumps({"pipemorph": {}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert paths_base(str(path)) == str(conf)
    assert paths_base(os.path.relpath(path)) == str(conf)  # "../conf/ds_config.json" from elsewhere
    assert paths_base(path) == str(conf)  # os.PathLike
    assert paths_base({"pipemorph": {}}) == str(elsewhere)
    assert paths_base(base64.urlsafe_b64encode(b'{"pipemorph": {}}').decode()) == str(elsewhere)


def test_a_missing_relative_plan_file_is_named_by_its_absolute_path(tmp_path):
    section = resolve_paths({"schedule": "plan", "plan_file": "plans/p.yaml"}, tmp_path / "conf")
    with pytest.raises(PipeMorphConfigError) as e:
        build_plan(parse_config(section), 4, 8)
    assert str(e.value) == f"ds_config pipemorph.plan_file {tmp_path}/conf/plans/p.yaml: no such file"
