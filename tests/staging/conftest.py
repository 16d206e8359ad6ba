"""Shared fixtures for the staging-ring tests: one JIT build per session (about 20-60 s the first time)."""
import os
import uuid

import pytest


@pytest.fixture(scope="session")
def staging_op():
    from ds_pipemorph.staging.builder import StagingRingBuilder

    return StagingRingBuilder().load()


@pytest.fixture
def ring_name():
    """A fresh shm name; unlinked afterwards in case a test failed before closing its ring."""
    name = f"pm_test_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass
