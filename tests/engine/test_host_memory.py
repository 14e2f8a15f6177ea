import subprocess
import sys

import pytest

from tokenmill.engine.host_memory import reuse_freed_memory

# Allocates and frees a 64 MiB tensor (Gemma 3's logits for 64 rows) ten times, touching every
# page, and prints the page faults that took after two warm-up rounds. glibc maps anything over
# 32 MiB afresh every time unless its thresholds are raised.
FAULTS = """
import resource, sys, torch
from tokenmill.engine.host_memory import reuse_freed_memory
if sys.argv[1] == "on":
    assert reuse_freed_memory()
torch.ones(2**24)
torch.ones(2**24)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(2**24)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(setting: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", FAULTS, setting], capture_output=True, text=True, check=True
    )
    return int(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_tensor_pages_are_reused_instead_of_faulted_in_again():
    # Off, every round faults the whole tensor in again (16,384 pages, or 32 huge pages where
    # transparent huge pages are always on). On, at most one more growth of the heap (Python's own
    # small objects can land past the freed tensor), not one per round.
    off, on = _faults("off"), _faults("on")
    assert off > 0 and on * 5 <= off


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_reuse_is_applied_where_the_c_library_has_mallopt():
    assert reuse_freed_memory() is True
