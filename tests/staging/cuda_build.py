"""Compiles the CUDA staging op the way ``StagingRingCUDABuilder().load()`` would on a GPU host, on a machine
without a GPU (run as a script in a subprocess: it sets process-wide state).

    python cuda_build.py OUT_DIR

What ``load()`` does on a GPU host, and what this script does instead where that needs a GPU:

1. DeepSpeed's ``OpBuilder.jit_load`` sets ``build_for_cpu = not torch.cuda.is_available()`` (False there) and
   ``jit_mode``, then takes the builder's ``sources()``, ``include_paths()``, ``cxx_args()`` and ``nvcc_args()``
   and appends ``-UC10_USE_GLOG`` (and the BF16 flags when every arch supports it). Same here, with the arch list
   from ``TORCH_CUDA_ARCH_LIST`` (jit_load would read it from the GPUs).
2. ``torch.utils.cpp_extension.load(with_cuda=True)`` writes a ninja file with
   ``_write_ninja_file_to_build_library`` and runs ninja. Same function here, so the compiler command lines are
   torch's. It needs ``CUDA_HOME``, which a CPU build of torch leaves unset: it is set from $CUDA_HOME, else
   /usr/local/cuda (the toolkit the nvcc on PATH belongs to on this machine).
3. The link: torch adds ``-lc10_cuda -ltorch_cuda``, which a CPU torch does not ship and this op does not use;
   the library links against libcudart and torch's CPU libraries instead, so it can be imported here.

Prints a JSON object: {"name", "objects": {source: object path}, "library"}.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_ext

from ds_pipemorph.staging.builder import StagingRingCUDABuilder


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda_home = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")
    cpp_ext.CUDA_HOME = str(cuda_home)

    b = StagingRingCUDABuilder()
    b.build_for_cpu, b.jit_mode = False, True  # what jit_load sets when a GPU is visible
    sources = [os.path.abspath(b.deepspeed_src_path(p)) for p in b.sources()]
    includes = [os.path.abspath(b.deepspeed_src_path(p)) for p in b.include_paths()]
    nvcc_args = b.strip_empty_entries(b.nvcc_args()) + ["-UC10_USE_GLOG"]
    cxx_args = b.strip_empty_entries(b.cxx_args()) + ["-UC10_USE_GLOG"]
    if b.enable_bf16:  # set by compute_capability_args() from the arch list, as in jit_load
        cxx_args.append("-DBF16_AVAILABLE")
        nvcc_args += ["-DBF16_AVAILABLE", "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__",
                      "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
    ldflags = b.strip_empty_entries(b.extra_ldflags()) + [
        f"-L{cpp_ext.TORCH_LIB_PATH}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python",
        f"-L{cuda_home / 'lib64'}", "-lcudart", f"-Wl,-rpath,{cuda_home / 'lib64'}"]
    cpp_ext._write_ninja_file_to_build_library(
        path=str(out / "build.ninja"), name=b.name, sources=sources, extra_cflags=cxx_args,
        extra_cuda_cflags=nvcc_args, extra_sycl_cflags=[], extra_ldflags=ldflags, extra_include_paths=includes,
        with_cuda=True, with_sycl=False, is_standalone=False)
    subprocess.run(["ninja", "-C", str(out), "-j", "2"], check=True, stdout=sys.stderr, stderr=sys.stderr)
    objects = {Path(s).name: str(out / (Path(s).stem + (".cuda.o" if s.endswith(".cu") else ".o"))) for s in sources}
    print(json.dumps({"name": b.name, "objects": objects, "library": str(out / f"{b.name}.so"),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main(sys.argv[1])
