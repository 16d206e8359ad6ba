"""Reading the partition a checkpoint was saved on (``runtime.checkpoint.saved_parts``), as DeepSpeed
resolves the checkpoint's tag."""
from __future__ import annotations

import pytest

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.runtime.checkpoint import PARTS_FILE, saved_parts


def _checkpoint(root, tag: str, parts_json: str | None, latest: bool = True):
    (root / tag).mkdir(parents=True)
    if parts_json is not None:
        (root / tag / PARTS_FILE).write_text(parts_json)
    if latest:
        (root / "latest").write_text(tag + "\n")


def test_the_tag_comes_from_latest_unless_given_and_a_checkpoint_without_the_file_says_nothing(tmp_path):
    _checkpoint(tmp_path, "global_step3", '{"parts": [0, 11, 13, 16, 18]}')
    _checkpoint(tmp_path, "7", None, latest=False)
    assert saved_parts(str(tmp_path), None, layers=18, stages=4) == [0, 11, 13, 16, 18]
    assert saved_parts(str(tmp_path), 7, layers=18, stages=4) is None  # a tag that is not a string, as DeepSpeed allows
    assert saved_parts(str(tmp_path / "nowhere"), None, layers=18, stages=4) is None  # no latest: DeepSpeed warns


def test_a_partition_of_another_model_is_one_sentence_naming_the_file(tmp_path):
    _checkpoint(tmp_path, "global_step3", '{"parts": [0, 5, 10, 14, 20]}')
    with pytest.raises(BadInput, match=r"global_step3/pipemorph_parts.json: .*ends at 20 but the model has 18 layers"):
        saved_parts(str(tmp_path), None, layers=18, stages=4)
