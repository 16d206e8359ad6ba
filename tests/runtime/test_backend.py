"""Which process-group backends the direct transport can run on (no ranks)."""
import pytest

from ds_pipemorph.runtime.engine import backend_reason


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_nccl_with_direct_links_is_refused_naming_the_setting(mode):
    reason = backend_reason("nccl", mode)
    assert reason is not None and 'delegation.mode to "always"' in reason and "NCCL" in reason


@pytest.mark.parametrize("backend,mode", [("nccl", "always"), ("gloo", "off"), ("gloo", "auto"), ("gloo", "always")])
def test_gloo_runs_every_mode_and_nccl_runs_with_every_link_delegated(backend, mode):
    assert backend_reason(backend, mode) is None
