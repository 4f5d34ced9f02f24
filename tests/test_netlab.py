"""The network lab's hosts: their own namespace and, when asked, their own share of the CPU."""

import os
import subprocess
import sys

import pytest

from ravnest_swarm.netlab import NetLab, cpu_quota_available, namespaces_available

# burns half a second of CPU, then prints the share of a core it got and its addresses
BURN = """
import subprocess, time
cpu, wall = time.process_time(), time.time()
while time.process_time() - cpu < 0.5:
    pass
print(0.5 / (time.time() - wall))
print(subprocess.run(["ip", "-4", "addr", "show", "eth0"], capture_output=True, text=True).stdout)
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not (namespaces_available() and cpu_quota_available()), reason="needs root, ip and cgroups")
def test_a_host_with_a_cpu_quota_gets_that_share_and_nothing_is_left_behind():
    with NetLab(2, cpus=0.25) as lab:
        done = subprocess.run(lab.exec_prefix(1) + [sys.executable, "-c", BURN], capture_output=True, text=True,
                              timeout=30)
        cgroup = lab.cgroup(1)
        assert os.path.isdir(cgroup)
    assert done.returncode == 0, done.stderr
    share, addresses = done.stdout.split("\n", 1)
    # the quota is a ceiling: a loaded machine may give less, never more (10 ms periods, so little slack)
    assert 0.02 < float(share) < 0.32, share
    assert lab.host_ip(1) in addresses
    assert not os.path.exists(cgroup)
