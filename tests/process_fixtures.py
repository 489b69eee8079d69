"""Watching a process tree through /proc: which descendants a command started, and whether any
outlived it (the orchestration's promise that no child survives it)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time in ticks) from /proc, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], int(fields[19])


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def track(root: int, seen: dict[int, int]) -> None:
    """Add every live descendant of `root` to `seen` (pid → start time)."""
    family = {root} | set(seen)
    for pid in all_pids():
        st = stat(pid)
        if st and st[0] in family and pid not in seen:
            seen[pid] = st[2]


def alive(pid: int, start: int) -> bool:
    st = stat(pid)
    return st is not None and st[2] == start and st[1] != "Z"  # a zombie is dead, only not reaped


def cmdlines_with(text: str) -> list[str]:
    out = []
    for pid in all_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{pid}: {cmd}")
    return out


class Watched:
    """A command whose output is collected and whose descendants are recorded while it runs
    (pid → start time, in `seen`), so that survivors can be looked for after it ended."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.seen: dict[int, int] = {}
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float) -> bool:
        """Record descendants until `text` is printed (True), the command ends or time runs out."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            track(self.proc.pid, self.seen)
            if text in self.output:
                return True
            time.sleep(0.2)
        return text in self.output

    def finish(self, timeout_s: float) -> int:
        """Record descendants until the command ends (killed after `timeout_s`); its exit code."""
        self.wait_for("\0never printed\0", timeout_s)
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        self._reader.join(10)
        return code

    def survivors(self) -> list[int]:
        return [pid for pid, start in self.seen.items() if alive(pid, start)]


def run_watched(argv: list[str], timeout_s: float) -> tuple[int, str, dict[int, int]]:
    """Run, recording every descendant while it runs; (exit code, output, descendants)."""
    watched = Watched(argv)
    code = watched.finish(timeout_s)
    return code, watched.output, watched.seen
