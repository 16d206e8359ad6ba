"""Message tags of migration and re-mapping (``runtime.transfer``), without ranks.

A blob is two messages, its size on a tag and its bytes on the next one. A migration attempt may
send a blob to the next stage and one to the previous stage: 4 tags. A re-mapping attempt sends a
stage's state to one rank: 2 tags. Every message of every attempt of either kind needs a tag no
other one uses, or a late message of a failed attempt could be taken for a later one's.
"""
import itertools

import pytest

from ds_pipemorph.runtime.transfer import Purpose, Transfer, blob_tags, tags

MESSAGES_PER_BLOB = 2  # size, bytes
BLOBS = {Purpose.MIGRATION: 2, Purpose.REMAP: 1}  # per attempt, as the module docstrings describe them


def messages(purpose, attempt):
    """The tags the protocol puts on the wire in one attempt: each blob's tag and the one after."""
    return [t + k for t in blob_tags(purpose, attempt) for k in range(MESSAGES_PER_BLOB)]


@pytest.mark.parametrize("purpose", list(Purpose))
def test_an_attempt_has_one_tag_per_message_it_may_send(purpose):
    for attempt in (0, 1, 7, 1000):
        assert len(blob_tags(purpose, attempt)) == BLOBS[purpose]
        sent = messages(purpose, attempt)
        assert len(set(sent)) == MESSAGES_PER_BLOB * BLOBS[purpose]
        assert set(sent) == set(tags(purpose, attempt))  # every message inside the purpose's range
        assert min(sent) >= 0


def test_migration_and_remapping_never_share_a_tag_in_any_two_attempts():
    attempts = range(200)
    ranges = {(p, a): set(tags(p, a)) for p in Purpose for a in attempts}
    for (one, a), (other, b) in itertools.combinations(ranges, 2):
        assert not ranges[one, a] & ranges[other, b], f"{one.name} attempt {a} and {other.name} attempt {b}"
    # 200 attempts of each purpose, 4 + 2 tags each, no tag counted twice
    assert len(set().union(*ranges.values())) == 200 * (4 + 2)


def test_interleaved_attempts_of_one_engine_put_every_message_on_its_own_tag():
    # one engine's attempt counter serves both: migrate, migrate, re-map, migrate, re-map, ...
    transfer = Transfer()
    order = [Purpose.MIGRATION, Purpose.MIGRATION, Purpose.REMAP, Purpose.MIGRATION, Purpose.REMAP] * 20
    wire = [t for purpose in order for t in messages(purpose, transfer.next_attempt())]
    assert transfer.attempts == len(order)
    assert len(wire) == 60 * 4 + 40 * 2
    assert len(set(wire)) == len(wire)


def test_a_negative_attempt_is_refused():
    with pytest.raises(ValueError, match="attempt -1"):
        tags(Purpose.REMAP, -1)


def test_migration_and_re_mapping_each_take_their_tags_with_their_own_purpose():
    """The disjoint ranges above help only if each protocol asks for its own: read their calls."""
    import ast
    from pathlib import Path

    runtime = Path(__file__).resolve().parents[2] / "ds_pipemorph" / "runtime"
    for module, purpose in (("migrate.py", "MIGRATION"), ("remap.py", "REMAP")):
        calls = [node for node in ast.walk(ast.parse((runtime / module).read_text()))
                 if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "blob_tags"]
        assert calls, f"{module} no longer calls blob_tags"
        for call in calls:
            arg = call.args[0]
            assert isinstance(arg, ast.Attribute) and arg.attr == purpose and getattr(arg.value, "id", "") == "Purpose", \
                f"{module}:{call.lineno} takes its tags as {ast.unparse(arg)}, not Purpose.{purpose}"
