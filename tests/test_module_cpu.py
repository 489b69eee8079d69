"""`--module-cpu`'s measure (tests/module_cpu.py): a grandchild's CPU counts while it runs and, once
reaped, once only."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.module_cpu import tree_cpu_s

BURN_S = 0.5
# a grandchild burns BURN_S of CPU, says so, and waits for its stdin to close
GRANDCHILD = f"""
import sys, time
while time.process_time() < {BURN_S}:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""
CHILD = f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {GRANDCHILD!r}]).returncode)"


def test_a_grandchilds_cpu_counts_while_it_lives_and_once_reaped():
    before = tree_cpu_s(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "burnt\n"
        live_s = tree_cpu_s(os.getpid()) - before  # the grandchild, two levels down, still running
        child.stdin.close()
        assert child.wait(30) == 0
    finally:
        child.kill()
    reaped_s = tree_cpu_s(os.getpid()) - before  # now in this process's cutime, through the child's
    # /proc's times are sampled at the clock tick: a few ticks short of the burn under load (0.49999 seen)
    assert live_s >= 0.8 * BURN_S, live_s
    # counted twice would add another BURN_S; the interpreters' exits cost far less
    assert reaped_s - live_s < BURN_S / 2, (live_s, reaped_s)
