"""A model process ends with its serving process (serve/worker.exit_with_parent), even while it is
still loading: a parent started here spawns a child that calls it and then sleeps as a long load
would; the parent is killed with SIGKILL (no shutdown code runs) and the child must be gone within
seconds instead of loading on as an orphan."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

PARENT = textwrap.dedent(
    """
    import multiprocessing, time
    from hstu.serve.worker import exit_with_parent

    def child():
        exit_with_parent(0.05)
        time.sleep(120)  # a long load

    if __name__ == "__main__":
        p = multiprocessing.get_context("spawn").Process(target=child)
        p.start()
        print(p.pid, flush=True)
        time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    """Running or sleeping (a zombie left for its new parent to reap counts as ended)."""
    try:
        state = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "Z" not in state.split()[1]


def test_a_model_process_ends_when_its_server_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env={**os.environ})
    pid = int(proc.stdout.readline())
    time.sleep(1.0)  # the child is up and watching
    assert _alive(pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"model process {pid} outlived its killed parent"
