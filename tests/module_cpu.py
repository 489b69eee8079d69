"""Opt-in: the CPU each test module costs, `--module-cpu=FILE` (registered in tests/conftest.py).

Wall time says little on a shared machine; CPU is what the suite is bound by. Each worker appends a
line per module to FILE: `cpu_s wall_s module`, where cpu_s is the user + system time of the worker
and its whole process tree over the module (servers, vLLMs, subprocesses, the session's ClickHouse):

    cpu_s = Δ(worker's utime + stime + cutime + cstime + Σ over live descendants of the same four)

A child that exits and is reaped moves its time from the live sum into the worker's cutime, so it
counts once; an orphan reparented away from the tree (its parent died first) is missed. A session
fixture is charged to the module that first asks for it.
`sort -rn FILE` ranks the modules.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime + stime + cutime + cstime in ticks), or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # fields[0] is stat's 3rd field, the state
    return int(fields[1]), sum(int(f) for f in fields[11:15])


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root`, its reaped children and every live descendant (formula in the module docstring)."""
    procs = {pid: st for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if (st := _stat(pid))}
    family, ticks, grew = {root}, 0, True
    while grew:  # descendants at any depth: add children of the family until none is new
        new = {pid for pid, (ppid, _) in procs.items() if ppid in family and pid not in family}
        family |= new
        grew = bool(new)
    for pid in family:
        ticks += procs[pid][1] if pid in procs else 0
    return ticks / _TICKS_PER_S


@dataclass(slots=True)
class _Module:
    name: str
    cpu_s: float
    wall_s: float


class ModuleCpu:
    """Writes a module's line when the next module starts, and the last one at the session's end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.current: _Module | None = None

    def _close(self) -> None:
        if self.current is None:
            return
        cpu_s = tree_cpu_s(os.getpid()) - self.current.cpu_s
        wall_s = time.monotonic() - self.current.wall_s
        with open(self.path, "a") as f:
            f.write(f"{cpu_s:8.1f} {wall_s:8.1f} {self.current.name}\n")
        self.current = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        """Called where tests run (an xdist worker; not its controller, which sees every worker's logstart)."""
        module = item.nodeid.split("::", 1)[0]
        if self.current is None or self.current.name != module:
            self._close()
            self.current = _Module(module, tree_cpu_s(os.getpid()), time.monotonic())

    def pytest_sessionfinish(self) -> None:
        self._close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--module-cpu", metavar="FILE", help="append each module's CPU and wall seconds to FILE")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("module_cpu")
    if path:
        config.pluginmanager.register(ModuleCpu(os.path.abspath(path)), "module_cpu_recorder")
