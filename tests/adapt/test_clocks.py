"""Clock offsets between neighbours: one host reads one monotonic clock (pure logic, no ranks)."""
import subprocess
import sys

from ds_pipemorph.runtime.clocks import boot_key, settle


def test_processes_of_one_boot_share_a_key():
    other = subprocess.run([sys.executable, "-c", "from ds_pipemorph.runtime.clocks import boot_key; print(boot_key())"],
                           capture_output=True, text=True, check=True, timeout=60)
    assert int(other.stdout) == boot_key() and 0 <= boot_key() < 2**62  # fits an int64 tensor


def test_one_clock_reads_zero_offset_when_the_ping_estimate_is_only_noise():
    # all pings disturbed: best round trip 8 ms, estimate -3.9 ms (it would shift every delay of the link)
    assert settle(-3_900_000, 8_000_000, same_clock=True) == 0
    # another host, or a time namespace: the estimate stands
    assert settle(-3_900_000, 8_000_000, same_clock=False) == -3_900_000
    # one boot id but an offset far beyond the estimate's uncertainty (its own time namespace)
    assert settle(5_000_000_000, 200_000, same_clock=True) == 5_000_000_000
