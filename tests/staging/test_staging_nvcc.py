"""The CUDA side cannot run here (no GPU) but must compile with this machine's nvcc."""
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

CUDA_EXT = Path(__file__).resolve().parents[2] / "cuda_ext"


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")
def test_cuda_ring_compiles_with_nvcc(tmp_path):
    obj = tmp_path / "staging_ring_cuda.o"
    cmd = ["nvcc", "-c", str(CUDA_EXT / "staging_ring_cuda.cu"), "-I", str(CUDA_EXT), "-std=c++17",
           "-Xcompiler", "-Wall,-Werror,-fPIC", "-o", str(obj)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    assert obj.stat().st_size > 0
    syms = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, check=False).stdout
    for fn in ("enqueue_send", "enqueue_recv", "register_host", "unregister_host"):
        assert f"pipemorph::staging::cuda::{fn}" in syms, f"{fn} missing from the object file"
    assert "cudaLaunchHostFunc" in syms and "cudaMemcpyAsync" in syms


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")
def test_cuda_binding_compiles_against_torch_headers():
    # The CUDA op's torch binding includes no CUDA header, so g++ can check it against torch's headers here.
    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx, "a C++ compiler is needed to JIT-build the op anyway"
    incs = [f"-isystem{p}" for p in include_paths()] + [f"-isystem{sysconfig.get_paths()['include']}"]
    for src in ("staging_ring_cuda_bind.cpp",):
        cmd = [cxx, "-fsyntax-only", "-std=c++20", "-DTORCH_EXTENSION_NAME=syntax_check",
               "-DTORCH_API_INCLUDE_EXTENSION_H", "-DPIPEMORPH_STAGING_WITH_CUDA", f"-I{CUDA_EXT}", *incs,
               "-Wall", "-Werror", str(CUDA_EXT / src)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert res.returncode == 0, f"{src}:\n{res.stderr[-4000:]}"
