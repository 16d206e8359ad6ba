"""Where a delegated message is cut (``framing.piece_bytes``), from the rule: at most ``slots`` pieces so
that a message fits one queue's ring, none below 256 KiB, none above a slot; whole slots otherwise."""
from ds_pipemorph.runtime.transport.delegated import framing

MIB = 1 << 20
SLOT = 64 * MIB


def test_whole_slots_without_the_cut():
    assert framing.piece_bytes(32 * MIB, SLOT, 4, fit_ring=False) == SLOT


def test_a_message_is_cut_into_at_most_slots_pieces_that_fill_one_ring():
    for total in (32 * MIB, 4 * MIB + 576, 3 * MIB + 1):
        cut = framing.piece_bytes(total, SLOT, 4, fit_ring=True)
        assert cut % framing.ALIGN == 0 and cut >= total / 4
        assert framing.pieces_of(total, cut) <= 4 and 4 * cut < total + 4 * framing.ALIGN + 4
    assert framing.piece_bytes(32 * MIB, SLOT, 4, fit_ring=True) == 8 * MIB


def test_small_messages_keep_the_floor_and_large_ones_the_slot():
    assert framing.piece_bytes(1000, SLOT, 4, fit_ring=True) == framing.MIN_PIECE_BYTES  # one piece
    assert framing.pieces_of(1000, framing.MIN_PIECE_BYTES) == 1
    assert framing.piece_bytes(1000 * MIB, SLOT, 4, fit_ring=True) == SLOT  # larger than a ring: whole slots
    assert framing.piece_bytes(32 * MIB, 4096, 4, fit_ring=True) == 4096  # a slot smaller than the floor
