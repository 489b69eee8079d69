"""benchmarks/peers.py's meter and its pause: a server's process tree counted once, every process of
an unmeasured server stopped while another is measured and running again after."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.peers import Peer, others_paused, tree_cpu_ns
from benchmarks.vllm_plugin_overhead import _descendants
from phaselens.common.process import terminate

# a process that spins, with a child that spins: a server and its engine process
SPINNING_TREE = (
    "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])\nwhile True: pass\n"
)


def _clock_ticks_ns(pid: int) -> int:
    """utime + stime of one process from /proc/PID/stat (clock ticks, 100 a second): a second
    meter, independent of the schedstat one under test."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 10_000_000


@pytest.fixture
def spinning_tree():
    proc = subprocess.Popen([sys.executable, "-c", SPINNING_TREE])
    deadline = time.monotonic() + 30
    while not _descendants(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _descendants(proc.pid), "the spinning child did not start"
    yield proc
    for pid in _descendants(proc.pid):
        subprocess.run(["kill", "-9", str(pid)], check=False)
    terminate(proc, 5)


def test_the_tree_is_counted_once(spinning_tree):
    pids = [spinning_tree.pid, *_descendants(spinning_tree.pid)]
    time.sleep(0.5)
    ticks_ns, meter_ns = sum(map(_clock_ticks_ns, pids)), tree_cpu_ns(spinning_tree.pid)
    # the two meters agree within a few clock ticks each; a root counted twice would be ~1.5x
    assert abs(meter_ns - ticks_ns) < 0.15 * ticks_ns + 40_000_000, (meter_ns, ticks_ns)


def test_other_servers_are_stopped_while_one_is_measured_and_run_after(spinning_tree):
    other = Peer("other", "", "m", spinning_tree.pid, lambda: None)
    measured = Peer("measured", "", "m", 0, lambda: None)
    with others_paused([other, measured], measured, pause=True):
        time.sleep(0.05)  # a signal is delivered at the process's next return from the kernel
        before = tree_cpu_ns(spinning_tree.pid)
        time.sleep(0.5)
        paused_ns = tree_cpu_ns(spinning_tree.pid) - before
    before = tree_cpu_ns(spinning_tree.pid)
    time.sleep(0.5)
    running_ns = tree_cpu_ns(spinning_tree.pid) - before
    assert paused_ns == 0
    assert running_ns > 10_000_000  # two spinning processes for 0.5 s: far more, however loaded the machine
    with others_paused([other, measured], measured, pause=False):
        before = tree_cpu_ns(spinning_tree.pid)
        time.sleep(0.3)
        assert tree_cpu_ns(spinning_tree.pid) > before  # --no-pause: left running


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no autogroup scheduling here")
def test_a_server_in_its_own_session_gets_the_benchmarks_nice_for_its_group():
    """A new session is a new autogroup at nice 0, whatever its processes' nice; a benchmark at
    nice 3 (a raise needs no privilege) gives it 3."""
    server = subprocess.Popen(["sleep", "30"], start_new_session=True)
    group = Path(f"/proc/{server.pid}/autogroup")
    try:
        assert group.read_text().split()[-1] == "0"
        code = f"import os; from benchmarks.peers import give_our_nice; os.nice(3); give_our_nice({server.pid})"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1], timeout=60)
        assert group.read_text().split()[-1] == "3"
    finally:
        terminate(server, 5)
