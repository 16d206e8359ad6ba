"""Which staging data path a delegated transport takes: the CUDA one exactly when its tensors live on a CUDA
device, decided from the device descriptor alone (so it is checked here, without a GPU)."""
import types

import pytest
import torch

from ds_pipemorph.runtime.config import parse_config
from ds_pipemorph.runtime.transport.router import build_transport
from ds_pipemorph.staging.device_path import CudaPath, HostPath, select_path, uses_cuda


@pytest.mark.parametrize("device, index", [
    (torch.device("cuda", 0), 0),
    (torch.device("cuda:3"), 3),
    (torch.device("cuda"), None),  # the current device, resolved on first use
    ("cuda:1", 1),
    (types.SimpleNamespace(type="cuda", index=2), 2),  # any descriptor with .type / .index
])
def test_cuda_devices_take_the_cuda_path(device, index):
    assert uses_cuda(device)
    path = select_path(device)
    assert isinstance(path, CudaPath) and path.cuda and path.index == index


@pytest.mark.parametrize("device", [
    None, torch.device("cpu"), "cpu", torch.device("meta"), types.SimpleNamespace(type="xpu", index=0),
    types.SimpleNamespace(type="hpu", index=None),
])
def test_every_other_device_takes_the_host_path(device):
    if device is not None:
        assert not uses_cuda(device)
    path = select_path(device)
    assert isinstance(path, HostPath) and not path.cuda
    assert path.recv_device == torch.device("cpu")  # the ring is host memory: messages land there first


def test_host_path_moves_tensors_only_when_the_transport_device_is_not_the_cpu():
    t = torch.arange(4)
    assert select_path("cpu").hand_over([t], None)[0] is t
    assert select_path(torch.device("meta")).hand_over([t], None)[0].device.type == "meta"


def test_selecting_the_cuda_path_touches_no_cuda_api():
    # Built on a machine without a GPU: streams and the device are resolved only when a copy is first made.
    path = select_path(torch.device("cuda", 1))
    assert path._streams is None and path._device is None


STORE_PORT = 29500  # never contacted: no delegate starts in these tests


def _cfg(mode):
    return parse_config({"delegation": {"mode": mode}})


@pytest.mark.parametrize("device, cuda", [(torch.device("cuda", 1), True), (torch.device("cpu"), False), (None, False)])
def test_the_engine_device_chooses_the_transport_path(device, cuda):
    # What the engine does: build_transport(..., self.device); "off" starts no fork server and loads no op.
    router = build_transport(_cfg("off"), 0, 0, [0, 1], device, store_port=STORE_PORT)
    path = router.delegated.staging_path
    assert path.cuda is cuda
    if cuda:
        assert path.index == device.index


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks which op is asked for on a machine without a GPU")
def test_a_cuda_transport_asks_for_the_cuda_op_only():
    router = build_transport(_cfg("off"), 0, 0, [0, 1], torch.device("cuda", 0), store_port=STORE_PORT)
    with pytest.raises(RuntimeError, match="pipemorph_staging_cuda_"):
        router.delegated._load_op()  # the CUDA builder refuses here (no GPU); the CPU op is not a fallback
    assert router.delegated._op is None
