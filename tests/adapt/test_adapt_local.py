"""What one rank measures for the control loop (``Adapter._local``): the median F, B and W of its
iteration, leaving out the B and W of a micro-batch that ran as one backward pass
(``pipemorph.backward``, the first stage's back-to-back pairs): that B holds its W's time too."""
from types import SimpleNamespace

from ds_pipemorph.control.estimate import Neighbours
from ds_pipemorph.runtime.adapt import Adapter
from ds_pipemorph.runtime.oprecords import OpRecord
from ds_pipemorph.runtime.overhead import Overhead

MS = 1_000_000


def _records(durations_ms: dict) -> list:
    out, t = [], 0
    for op, ms in durations_ms.items():
        out.append(OpRecord(op, t, t + int(ms * MS)))
        t += int(ms * MS) + MS
    out.append(OpRecord("SEND_B1", t, t + MS))  # not a compute op: never counted
    return out


def _local(records, whole=()):
    me = SimpleNamespace(stage_id=1, neighbours=Neighbours(0, 2))
    return Adapter._local(me, records, Overhead(), None, whole)


def test_a_micro_batch_run_as_one_pass_is_left_out_of_b_and_w_but_not_of_f():
    records = _records({"F0": 2, "B0": 9, "W0": 0.01, "F1": 4, "B1": 5, "W1": 3, "F2": 6, "B2": 7, "W2": 4})
    assert _local(records) == [1.0, 4.0, 7.0, 3.0, 0.0, 2.0]  # every sample: B's median is the whole pass's
    assert _local(records, {0}) == [1.0, 4.0, 6.0, 3.5, 0.0, 2.0]  # B1, B2 and W1, W2 only
    # every backward one pass: no B or W measured (-1: the control loop keeps its last estimate)
    assert _local(records, {0, 1, 2}) == [1.0, 4.0, -1.0, -1.0, 0.0, 2.0]


def test_device_times_are_filtered_alike():
    me = SimpleNamespace(stage_id=0, neighbours=Neighbours(None, 1))
    got = Adapter._local(me, [], Overhead(), {"F0": 1.0, "B0": 8.0, "W0": 0.0, "B1": 2.0, "W1": 5.0}, {0})
    assert got == [0.0, 1.0, 2.0, 5.0, -1.0, 1.0]
