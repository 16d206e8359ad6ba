"""What live layer migration (``runtime.migrate``) and re-mapping (``runtime.remap``) share: the
gloo groups, the attempts and their message tags, the all-or-nothing vote, and state as blobs.

An attempt has two phases, so a failure changes nothing. Phase one: every rank sends and receives
what it must (``send_blob``/``recv_blob``) and builds the result beside what it runs (nothing of it
is touched); any exception there is this rank's no vote, its reason ``fileio.first_line(e, with_type=True)``. Phase two:
every rank votes (``Transfer.vote``: an all-reduce of "my part went well") and only if every rank
succeeded does each one commit; otherwise every rank keeps what it had.

The vote travels in a gloo group of its own, in which nothing ever times out early. Transfers
travel in another, with the transfer timeout: gloo closes a connection whose receive timed out, so
after a failed vote every rank (all of them voted) replaces that group together. Each attempt also
has message tags of its own (``tags``), so nothing of a failed attempt lands in a later one, and
migration and re-mapping never share a tag. Both groups are gloo: state travels through host memory
and never mixes with training messages, on NCCL jobs too.
"""
from __future__ import annotations

import contextlib
import enum
import io
from datetime import timedelta

import torch
import torch.distributed as dist


class Purpose(enum.Enum):
    """Who uses an attempt's tags."""

    MIGRATION = "migration"  # a blob to the next stage, a blob to the previous one
    REMAP = "remap"  # a stage's state to the rank that takes its coordinate


TAGS_PER_BLOB = 2  # its size, then its bytes (``send_blob``)
_BLOBS = {Purpose.MIGRATION: 2, Purpose.REMAP: 1}  # blobs one attempt may send, each on tags of its own
TAGS_PER_ATTEMPT = TAGS_PER_BLOB * sum(_BLOBS.values())


def tags(purpose: Purpose, attempt: int) -> range:
    """The message tags ``purpose`` may use in ``attempt``: every attempt has a block of
    ``TAGS_PER_ATTEMPT`` tags, split between the purposes in the order ``Purpose`` lists them."""
    if attempt < 0:
        raise ValueError(f"attempt {attempt}: attempts count from 0")
    start = attempt * TAGS_PER_ATTEMPT
    for p in Purpose:
        width = TAGS_PER_BLOB * _BLOBS[p]
        if p is purpose:
            return range(start, start + width)
        start += width
    raise ValueError(f"{purpose!r} is not a Purpose")


def blob_tags(purpose: Purpose, attempt: int) -> range:
    """The first tag of each blob ``purpose`` may send in ``attempt`` (``send_blob`` uses it and the next)."""
    return tags(purpose, attempt)[::TAGS_PER_BLOB]


class Transfer:
    """The groups and attempts of one engine; every rank builds one.

    Its gloo groups form at first use (every rank is in that call), or at once with ``eager`` (a
    job that expects to move state keeps the groups' set-up out of the first move).
    ``drop_payload_at`` (testing only): attempts at which this rank sends the size of each blob but
    not the blob, as a connection lost mid-transfer would leave it."""

    def __init__(self, timeout_s: float = 60.0, drop_payload_at: frozenset = frozenset(), eager: bool = False):
        self.timeout = timedelta(seconds=timeout_s)
        self.drop_payload_at = frozenset(drop_payload_at)
        self.attempts = 0
        self._group = None  # transfers; a timed-out receive closes gloo's connection, so it is rebuilt after one
        self._vote_group = None  # votes; nothing in it ever times out early
        if eager:  # every rank builds its engine here, so the groups form now, not in the first move
            self._form_groups()

    def vote_group(self):
        """The gloo group every rank votes in (formed here if no transfer formed it yet; every
        rank calls this together)."""
        if self._vote_group is None:
            self._form_groups()
        return self._vote_group

    def transfer_group(self):
        """The gloo group transfers travel in (formed here at first use: every rank calls this together)."""
        if self._group is None:
            self._form_groups()
        return self._group

    def _form_groups(self) -> None:
        if self._vote_group is None:
            self._vote_group = dist.new_group(backend="gloo")
        self._group = dist.new_group(backend="gloo", timeout=self.timeout)

    def next_attempt(self) -> int:
        """A fresh attempt number: its message tags (``tags``) were never used."""
        attempt, self.attempts = self.attempts, self.attempts + 1
        return attempt

    def drops(self, attempt: int) -> bool:
        """Whether this rank sends sizes only in ``attempt`` (testing: ``drop_payload_at``)."""
        return attempt in self.drop_payload_at

    def vote(self, ok: int) -> bool:
        """True if every rank's part went well (every rank calls this together). After a failed
        attempt the transfer group is replaced: gloo closes a connection whose receive timed out."""
        ballot = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(ballot, op=dist.ReduceOp.MIN, group=self.vote_group())
        if ballot.item() != 1:
            broken, self._group = self._group, dist.new_group(backend="gloo", timeout=self.timeout)
            try:
                dist.destroy_process_group(broken)
            except Exception:  # noqa: BLE001 - a group whose connection already closed may refuse; it is unused
                pass
            return False
        return True


# -- state as blobs --------------------------------------------------------------------------------
def packed_state(opt_state: dict) -> dict:
    """A parameter's optimizer state as it travels: tensors on the host, with their device kind
    (torch's Adam keeps ``step`` on the host even for GPU parameters)."""
    return {k: ({"tensor": v.detach().cpu(), "host": v.device.type == "cpu"} if torch.is_tensor(v) else v)
            for k, v in opt_state.items()}


def unpacked_state(sent: dict, device) -> dict:
    """``packed_state`` back, each tensor on the device kind it came from."""
    return {k: (_placed(v, device) if isinstance(v, dict) else v) for k, v in sent.items()}


def to_blob(obj) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_blob(blob: torch.Tensor):
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


def send_blob(blob: torch.Tensor, peer: int, group, tag: int, drop: bool = False) -> list:
    """Its size (tag) then the blob (tag + 1), non-blocking; ``drop`` (testing): the size only."""
    works = [dist.isend(torch.tensor([blob.numel()], dtype=torch.int64), peer, group, tag)]
    if not drop:
        works.append(dist.isend(blob, peer, group, tag + 1))
    return works


def recv_blob(peer: int, group, tag: int, timeout: timedelta) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64)
    dist.irecv(size, peer, group, tag).wait(timeout)
    blob = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.irecv(blob, peer, group, tag + 1).wait(timeout)
    return blob


@contextlib.contextmanager
def rng_kept(device):
    """Random numbers drawn inside (the initial weights of what a received state overwrites) leave
    training's generators as they were."""
    cuda = getattr(device, "type", "cpu") == "cuda"
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices):
        yield


def _placed(sent: dict, device) -> torch.Tensor:
    return sent["tensor"] if sent["host"] else sent["tensor"].to(device)
