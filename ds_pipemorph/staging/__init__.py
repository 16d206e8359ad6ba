"""Host staging for the decoupled data plane (PipeMorph §5.2): a shared-memory slot ring between the training
process and a delegate process, JIT-built from ``cuda_ext/`` through DeepSpeed's op builder.

Imports are lazy: ``import ds_pipemorph.staging`` loads neither torch nor deepspeed.
"""
__all__ = ["StagingRing", "StagingRingBuilder", "StagingRingCUDABuilder", "load_op", "op_builder", "select_path"]


def __getattr__(name):
    if name in ("StagingRing", "load_op", "op_builder"):
        from . import ring

        return getattr(ring, name)
    if name == "select_path":
        from . import device_path

        return device_path.select_path
    if name in ("StagingRingBuilder", "StagingRingCUDABuilder"):
        from . import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'ds_pipemorph.staging' has no attribute {name!r}")
