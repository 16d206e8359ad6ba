"""ds_pipemorph: zero-bubble pipeline schedules for DeepSpeed that re-plan around slow links.

The C++/CUDA sources of the host-staging op live in ``cuda_ext/`` at the top of the repository;
a wheel carries a copy as ``ds_pipemorph/staging/cuda_ext/``, where the op builder
(``ds_pipemorph.staging.builder.cuda_ext_dir``) finds them. An editable install reads them in place.
The C source of the planner's core (``ds_pipemorph/plan/sim/plancore.c``) is package data: every install
carries it, and ``ds_pipemorph.plan.sim.native`` compiles it at first use.
"""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

version = {}
exec(Path("ds_pipemorph/version.py").read_text(), version)

SOURCES = Path("cuda_ext")
PACKAGED = ("ds_pipemorph", "staging", "cuda_ext")


class BuildWithSources(build_py):
    """``build_py`` that also copies ``cuda_ext/*`` into the built package (skipped for editable installs)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib, *PACKAGED)
        self.mkpath(str(dest))
        for src in sorted(SOURCES.iterdir()):
            if src.suffix in (".cpp", ".cu", ".h"):
                self.copy_file(str(src), str(dest / src.name))

setup(
    name="ds_pipemorph",
    version=version["__version__"],
    description="Straggler-resilient zero-bubble pipeline parallelism for DeepSpeed (PipeMorph)",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["ds_pipemorph", "ds_pipemorph.*"]) + ["ds_pipemorph_cli"],
    package_dir={"ds_pipemorph_cli": "cli"},
    package_data={"ds_pipemorph.plan.sim": ["*.c"]},
    install_requires=[
        # A range, so GPU users keep their own torch build; scripts/setup.sh installs torch==2.13.0 for
        # development (PIPEMORPH_SKIP_TORCH=1 keeps the torch already installed).
        "torch>=2.4",
        "deepspeed>=0.19.8,<0.20",  # PipelineEngine._train_schedule (runtime/ds_compat.py)
        "pydantic>=2.6,<3",
        "typer>=0.12",
        "rich>=13",
        "PyYAML>=6",
        "nvtx>=0.2.10",
        "psutil>=5.9",  # network interfaces (delegation.interfaces); also a DeepSpeed requirement
    ],
    extras_require={
        "plot": ["matplotlib>=3.7"],
        "milp": ["highspy>=1.7"],
        # control.interference.SlowdownModel (a random forest) and benchmarks/control/interference_predictor.py
        "interference": ["scikit-learn>=1.3", "joblib>=1.2"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.8", "hypothesis>=6.100", "matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["pipemorph=ds_pipemorph_cli.app:console_main"]},
    cmdclass={"build_py": BuildWithSources},
)
