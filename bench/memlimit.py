"""Hold a process to a memory budget with a cgroup, as a user caps llama.cpp's page cache.

A child cgroup is made under this process's own memory cgroup (v2 ``memory.max`` or v1
``memory.limit_in_bytes``), the command is started inside it, and the command sets its own limit
once its non-expert weights are loaded (:func:`limit_self`): usage at that point plus the budget.
The kernel then evicts the cgroup's page-cache pages beyond the limit, so every expert that does
not fit is read from the disk again. Creating a cgroup needs root; :func:`available` says why not
when it cannot.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ENV = "MOECAST_CGROUP"


def _own_cgroup() -> tuple[Path, int] | None:
    """(directory of this process's memory cgroup, cgroup version), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if d.is_dir():
                return d, 1
    for line in lines:
        if line.startswith("0::"):
            d = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            if (d / "memory.max").exists() or (d.parent / "cgroup.controllers").exists():
                return d, 2
    return None


def _files(version: int) -> dict[str, str]:
    if version == 1:
        return {
            "limit": "memory.limit_in_bytes",
            "usage": "memory.usage_in_bytes",
            "peak": "memory.max_usage_in_bytes",
        }
    return {"limit": "memory.max", "usage": "memory.current", "peak": "memory.peak"}


def available() -> str | None:
    """None when a memory cgroup can be made here, else why not (one line)."""
    own = _own_cgroup()
    if own is None:
        return "no memory cgroup controller is mounted"
    if os.geteuid() != 0:
        return "making a cgroup needs root"
    probe = own[0] / f"moecast-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot make a cgroup under {own[0]} ({exc.strerror or exc})"
    return None


class Cgroup:
    """A child memory cgroup of this process's; ``run`` a command in it; ``remove`` when done."""

    def __init__(self, name: str) -> None:
        own = _own_cgroup()
        if own is None:
            raise OSError("no memory cgroup controller is mounted")
        self.dir = own[0] / f"{name}-{os.getpid()}"
        self.version = own[1]
        self.dir.mkdir()

    def read(self, key: str) -> int | None:
        try:
            text = (self.dir / _files(self.version)[key]).read_text().strip()
        except OSError:
            return None
        return None if text == "max" else int(text)

    def run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        procs = self.dir / "cgroup.procs"
        env = {**os.environ, ENV: f"{self.dir}:{self.version}"}
        return subprocess.run(
            cmd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=lambda: procs.write_text(str(os.getpid())),
        )

    def remove(self) -> None:
        for _ in range(50):  # the kernel frees the cgroup once its last task has gone
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def limit_self(budget_bytes: int, slack: float = 0.0, floor: int = 0) -> int | None:
    """In the command: cap its cgroup at its usage now plus ``budget_bytes``, plus ``slack`` of that sum
    and at least ``floor`` bytes of room for its own work; returns the limit."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    d, version = spec.rsplit(":", 1)
    files = _files(int(version))
    usage = int((Path(d) / files["usage"]).read_text().strip())
    held = usage + int(budget_bytes)
    limit = held + max(int(slack * held), int(floor))
    (Path(d) / files["limit"]).write_text(str(limit))
    return limit


def peak_bytes() -> int | None:
    """In the command: the cgroup's peak usage so far (page cache included)."""
    return _read_own("peak")


def usage_bytes() -> int | None:
    """In the command: the cgroup's usage now (page cache included)."""
    return _read_own("usage")


def _read_own(key: str) -> int | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    d, version = spec.rsplit(":", 1)
    try:
        text = (Path(d) / _files(int(version))[key]).read_text().strip()
    except OSError:
        return None
    return int(text)
