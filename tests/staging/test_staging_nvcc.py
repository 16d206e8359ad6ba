"""The CUDA staging op compiles, links and loads with this machine's nvcc through ``StagingRingCUDABuilder``'s own
sources and flags (compile-only here: there is no GPU, so no copy runs; ``cuda_build.py`` says what differs from
``load()`` on a GPU host). On a host with a GPU, the last test runs the CUDA path for real."""
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
needs_toolkit = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ninja") is None,
                                   reason="nvcc (CUDA toolkit) and ninja are needed to build the CUDA op")


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda_op")
    # Two architectures, one with PTX: the arch flags DeepSpeed derives from a GPU's compute capability.
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")}
    res = subprocess.run([sys.executable, str(HERE / "cuda_build.py"), str(out)], capture_output=True, text=True,
                         env=env, timeout=1500, check=False)
    assert res.returncode == 0, f"building the CUDA op failed:\n{res.stderr[-6000:]}"
    build = json.loads(res.stdout.strip().splitlines()[-1])
    build["ninja"] = (out / "build.ninja").read_text()
    return build


def symbols(obj: str, kind: str) -> set[str]:
    """Demangled names ``nm`` lists in ``obj``: kind "defined" (text/weak/data) or "undefined"."""
    lines = subprocess.run(["nm", "-C", obj], capture_output=True, text=True, check=True).stdout.splitlines()
    out = set()
    for line in lines:
        parts = line.split(maxsplit=2) if line[:1] != " " else ["", *line.split(maxsplit=1)]
        if len(parts) < 3:
            continue
        _, code, name = parts
        if (kind == "undefined") == (code == "U"):
            out.add(name.split("(")[0])
    return out


@needs_toolkit
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_builder_sources_compile_with_nvcc_and_export_the_cuda_path(cuda_build):
    from ds_pipemorph.staging.builder import StagingRingCUDABuilder

    b = StagingRingCUDABuilder()
    objs = cuda_build["objects"]
    assert set(objs) == {Path(s).name for s in b.sources()}  # every source of the builder, nothing else
    # The .cu file went through nvcc with DeepSpeed's CUDA flags and the builder's include path; the C++ files
    # with the builder's define that adds the CUDA binding.
    ninja = cuda_build["ninja"]
    assert "--use_fast_math" in ninja and "-gencode=arch=compute_90,code=compute_90" in ninja
    assert f"-I{b.include_paths()[0]}" in ninja and "-DPIPEMORPH_STAGING_WITH_CUDA" in ninja

    cu = objs["staging_ring_cuda.cu"]
    defined = symbols(cu, "defined")
    for fn in ("enqueue_send", "enqueue_recv", "register_host", "unregister_host"):
        assert f"pipemorph::staging::cuda::{fn}" in defined, f"{fn} missing from {cu}"
    # Fig. 11/12 as the runtime calls it: async copies, a host callback that flips the slot, pinning.
    cuda_calls = {"cudaMemcpyAsync", "cudaLaunchHostFunc", "cudaHostRegister", "cudaHostUnregister"}
    assert cuda_calls <= symbols(cu, "undefined")

    bind = objs["staging_ring_cuda_bind.cpp"]
    assert "bind_cuda" in symbols(bind, "defined")
    enqueues = {"pipemorph::staging::cuda::enqueue_send", "pipemorph::staging::cuda::enqueue_recv"}
    assert enqueues <= symbols(bind, "undefined")
    module = objs["staging_ring_cpu.cpp"]
    assert "bind_cuda" in symbols(module, "undefined")  # the module adds the CUDA methods to Ring
    assert f"PyInit_{cuda_build['name']}" in symbols(module, "defined")

    # Every symbol of the op's own code that one object needs, another defines: the pieces link into one op.
    ours = lambda names: {n for n in names if n.startswith("pipemorph::") or n == "bind_cuda"}  # noqa: E731
    needed = set().union(*(ours(symbols(o, "undefined")) for o in objs.values()))
    provided = set().union(*(symbols(o, "defined") for o in objs.values()))
    assert needed <= provided, f"unresolved: {sorted(needed - provided)}"


CHECK_LOADED_OP = r"""
import importlib.util, json, sys, torch
from ds_pipemorph.staging import StagingRing
name, path, ring_name = sys.argv[1:4]
spec = importlib.util.spec_from_file_location(name, path)
op = importlib.util.module_from_spec(spec)
spec.loader.exec_module(op)
out = {"with_cuda": op.WITH_CUDA, "methods": sorted(m for m in ("pin", "push_cuda", "pop_cuda", "end_write_cuda",
                                                             "end_read_cuda") if hasattr(op.Ring, m))}
with StagingRing.create(ring_name, slot_bytes=4096, num_slots=2, op=op) as ring:
    ring.push(torch.arange(6).view(2, 3), tag=7)  # the host path of the CUDA build
    got, tag = ring.pop(timeout_s=5.0)
    out["round_trip"] = [got.tolist(), tag]
    try:
        ring.pin()
    except RuntimeError as e:
        out["pin_error"] = str(e)
    class Stream:  # pin() failed: end_write_cuda refuses the bad span before any CUDA call
        cuda_stream = 0
    try:
        with ring.writing_async(16, 1, Stream()) as (view, spans):
            spans.append((8, 4096, 16))
    except ValueError as e:
        out["span_error"] = str(e)
    out["after"] = [ring.occupancy(), ring._h.head]
print(json.dumps(out))
"""


@needs_toolkit
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_cuda_op_loads_without_a_gpu_and_says_why_it_cannot_pin(cuda_build):
    ring_name = f"pm_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    res = subprocess.run([sys.executable, "-c", CHECK_LOADED_OP, cuda_build["name"], cuda_build["library"], ring_name],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["with_cuda"] is True
    assert out["methods"] == ["end_read_cuda", "end_write_cuda", "pin", "pop_cuda", "push_cuda"]
    assert out["round_trip"] == [[[0, 1, 2], [3, 4, 5]], 7]
    assert out["pin_error"].startswith(f"cannot pin staging ring '/{ring_name}'") and "cudaError" in out["pin_error"]
    assert "span of 16 bytes at offset 8 does not fit message 1 (16 bytes)" in out["span_error"]
    assert out["after"] == [0, 1]  # the refused slot went back: message 1 was never claimed


@pytest.mark.timeout(900)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_path_round_trip_on_a_gpu():
    """On a GPU host: a message in pieces crosses a ring D2H on one side stream and H2D on another, and the
    consumer's stream sees the bytes after waiting on the event only."""
    from ds_pipemorph.staging import StagingRing, load_op
    from ds_pipemorph.staging.device_path import select_path

    path = select_path(torch.device("cuda", 0))
    name = f"pm_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with StagingRing.create(name, slot_bytes=4096, num_slots=4, op=load_op(cuda=True)) as ring:
        path.pin(ring)
        src = torch.arange(3000, dtype=torch.float32, device="cuda").view(30, 100) * 2  # 12000 bytes: 3 pieces
        ready = path.sent([src])
        flat = src.reshape(-1).view(torch.uint8)
        with path.sending(ready):
            for a in range(0, flat.numel(), 4096):
                b = min(flat.numel(), a + 4096)
                with path.writing(ring, b - a, a, 5.0) as (_, spans):
                    spans.append((0, flat.data_ptr() + a, b - a))
        dst = torch.empty(30, 100, dtype=torch.float32, device="cuda")
        out = dst.reshape(-1).view(torch.uint8)
        with path.receiving():
            for _ in range(3):
                with path.reading(ring, 5.0) as (view, tag, spans):
                    spans.append((0, out.data_ptr() + tag, view.numel() * view.element_size()))
            done = path.received()
        (got,) = path.hand_over([dst], done)
        assert torch.equal(got.cpu(), torch.arange(3000, dtype=torch.float32).view(30, 100) * 2)
