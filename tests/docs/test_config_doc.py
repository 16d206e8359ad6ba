"""docs/config.md is generated from the pipemorph config models and agrees with them, key by key."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from ds_pipemorph.runtime import config_doc
from ds_pipemorph.runtime.config import PipeMorphConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"


def test_every_key_of_the_models_has_a_description_and_every_description_names_a_key():
    missing, unknown = config_doc.missing_and_unknown()
    assert missing == [], f"add these keys to config_doc.DESCRIPTIONS: {missing}"
    assert unknown == [], f"these descriptions name no key of the models: {unknown}"


def test_docs_config_md_is_what_the_models_generate():
    assert DOC.read_text() == config_doc.render(), (
        "docs/config.md differs from the models: run `python -m ds_pipemorph.runtime.config_doc`")


def _rows():
    """(key, type, default, meaning) of every table row of docs/config.md, read as a user reads it."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \| (.*?) \| (.*?) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    return rows


def test_the_documented_defaults_are_what_an_empty_section_validates_to():
    rows = _rows()
    assert "timeout_s" in rows and "delegation.mode" in rows and "inject.links.*.delay_ms" in rows
    # Independent of the generator: validate {} and read each documented top-level or section key back.
    cfg = PipeMorphConfig.model_validate({}).model_dump()
    checked = 0
    for key, (_, default, _) in rows.items():
        if "*" in key or default == "required" or key.startswith("inject.faults."):
            continue
        value = cfg
        for part in key.split("."):
            value = value[part]
        assert json.loads(default.strip("`")) == value, key
        checked += 1
    assert checked >= 30


@pytest.mark.parametrize("key, limit, refused, accepted", [
    ("delegation.queues", "≥ 1", 0, 1), ("delegation.slots", "≥ 2", 1, 2), ("timeout_s", "> 0", 0, 0.5),
    ("rebalance.min_gain", "< 1", 1, 0.99), ("adapt.search_evals", "≥ 1", 0, 1)])
def test_the_documented_limits_are_the_ones_the_models_enforce(key, limit, refused, accepted):
    assert limit in _rows()[key][0]
    outer, last = key.rsplit(".", 1) if "." in key else (None, key)

    def section(value):
        return {outer: {last: value}} if outer else {last: value}

    with pytest.raises(ValidationError):
        PipeMorphConfig.model_validate(section(refused))
    PipeMorphConfig.model_validate(section(accepted))


def test_the_generator_rewrites_the_file_and_check_reports_a_stale_one(tmp_path):
    out = tmp_path / "config.md"
    out.write_text("stale\n")
    cmd = [sys.executable, "-m", "ds_pipemorph.runtime.config_doc", "--out", str(out)]
    stale = subprocess.run([*cmd, "--check"], capture_output=True, text=True, timeout=120)
    assert stale.returncode == 1 and "differs" in stale.stdout and out.read_text() == "stale\n"
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    assert out.read_text() == DOC.read_text()
    assert subprocess.run([*cmd, "--check"], capture_output=True, timeout=120).returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["config.md"]  # no temporary file left behind


WRONG = {"integer": ("an integer", ["7", True, 7.5]), "number": ("a number", ["30", True]),
         "boolean": ("a boolean (true or false)", ["yes", 1, "true"]), "string": ("a string", [7, False])}


def _section(key: str, value) -> dict:
    """A section holding ``value`` at documented ``key`` (``*``: a link index; required neighbours filled)."""
    *outer, last = key.replace("*", "1").split(".")
    inner = {"link": 0, "after": 1} if outer[-1:] == ["kill_delegate"] else {}
    section = inner
    section[last] = value
    for name in reversed(outer):
        section = {name: section}
    return section


def test_the_documented_types_are_checked_not_converted():
    """Every key documented as an integer, number, boolean or string refuses a value of another type,
    naming the type the table gives; a whole number is accepted where a number is documented."""
    from ds_pipemorph.runtime.config import PipeMorphConfigError, parse_config

    checked = 0
    for key, (kind, _, _) in _rows().items():
        first = kind.split(" ")[0]
        if first not in WRONG:
            continue
        what, values = WRONG[first]
        for value in values:
            with pytest.raises(PipeMorphConfigError) as e:
                parse_config(_section(key, value))
            assert str(e.value).startswith(f"ds_config pipemorph: {key.replace('*', '1')}: expected {what}, got "), \
                (key, value, str(e.value))
        if first == "number":
            whole = 0 if "< 1" in kind else 1
            cfg = parse_config(_section(key, whole)).model_dump()
            for part in key.replace("*", "1").split("."):
                cfg = cfg[part]
            assert cfg == whole and type(cfg) is float, key
        checked += 1
    assert checked >= 30
