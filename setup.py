"""ds_pipemorph: zero-bubble pipeline schedules for DeepSpeed that re-plan around slow links."""
from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec(Path("ds_pipemorph/version.py").read_text(), version)

setup(
    name="ds_pipemorph",
    version=version["__version__"],
    description="Straggler-resilient zero-bubble pipeline parallelism for DeepSpeed (PipeMorph)",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["ds_pipemorph", "ds_pipemorph.*"]) + ["ds_pipemorph_cli"],
    package_dir={"ds_pipemorph_cli": "cli"},
    install_requires=[
        # A range, so GPU users keep their own torch build; scripts/setup.sh pins the CPU wheel here.
        "torch>=2.4",
        "deepspeed>=0.19.6,<0.20",
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
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["pipemorph=ds_pipemorph_cli.app:main"]},
)
