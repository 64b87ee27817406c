"""benchmarks/peers/host_load.py: a benchmark's own processes (this one, children alive or reaped) are not
"other processes"; a process outside its tree is."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.peers.host_load import OtherLoad, _busy_seconds

SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass"

pytestmark = pytest.mark.skipif(_busy_seconds() is None, reason="needs /proc/stat")


def test_own_children_are_never_others(monkeypatch):
    """The accounting alone: the machine's busy time made of exactly this tree's own plus a known amount
    "others" used, so no real load (a parallel test run's other worker) can leak in."""
    from benchmarks.peers import host_load

    others = {"s": 0.0}
    monkeypatch.setattr(
        host_load,
        "_busy_seconds",
        lambda: host_load._rusage_seconds() + sum(host_load._live_seconds().values()) + others["s"],
    )
    own = OtherLoad().start()
    subprocess.run([sys.executable, "-c", SPIN.format(s=0.3)], check=True)  # reaped
    alive = subprocess.Popen([sys.executable, "-c", SPIN.format(s=0.6)])
    time.sleep(0.3)
    assert own.others_share() == pytest.approx(0.0, abs=0.02)  # the live child's time so far is ours too
    alive.wait()
    assert own.others_share() == pytest.approx(0.0, abs=0.02)  # and once reaped
    other = OtherLoad().start()
    time.sleep(0.2)
    others["s"] += 0.1 * (os.cpu_count() or 1)  # 0.1 s on every CPU over the ~0.2 s: about half their time
    share = other.others_share()
    assert share == pytest.approx(0.5, rel=0.5)


@pytest.mark.slow  # real /proc/stat: under a parallel test run the other worker's load moves both windows
def test_own_children_are_not_others_and_an_orphan_is():
    own = OtherLoad().start()
    subprocess.run([sys.executable, "-c", SPIN.format(s=0.8)], check=True)  # reaped
    alive = subprocess.Popen([sys.executable, "-c", SPIN.format(s=0.8)])
    time.sleep(0.4)
    mine = own.others_share()  # the live child's time so far counts as ours too
    alive.wait()
    other = OtherLoad().start()
    # an orphan: the shell exits at once and leaves the spinner to init, outside this process's tree
    subprocess.run(["sh", "-c", f'{sys.executable} -c "{SPIN.format(s=1.0)}" >/dev/null 2>&1 &'], check=True)
    time.sleep(1.1)
    theirs = other.others_share()
    assert mine is not None and theirs is not None
    # one CPU busy for ~1 s of ~1.1 s is ~0.45 of a 2-CPU machine (less on more CPUs); ours should read
    # near 0, whatever else the machine does meanwhile shows in both
    assert theirs - mine > 0.25 / max(1, (os.cpu_count() or 1) / 2)
