"""README's compatibility table is the one ``runtime.compat`` renders from the engine's own sentences."""
from __future__ import annotations

from pathlib import Path

from ds_pipemorph.runtime import compat

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_holds_the_compatibility_table_as_rendered():
    assert compat.render() in README.read_text(), (
        "README's compatibility table differs from runtime.compat: paste `python -m ds_pipemorph.runtime.compat`")


def test_every_refused_row_is_one_sentence_naming_a_key_or_setting_to_change():
    for f in compat.FEATURES:
        if f.status == "refused":
            assert f.detail.count(". ") == 0 and not f.detail.endswith("."), f.detail
            assert any(w in f.detail for w in ("set ", "use ", "name only", "turn ", "remove ", "yet")), f.detail
        else:
            assert f.status == "trains"
