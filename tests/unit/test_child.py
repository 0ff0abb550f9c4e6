# SPDX-License-Identifier: GPL-3.0-or-later
"""The run's children end with it: a child started with ``child_env`` that calls ``die_with_parent`` (as the
sample renderer does first) is killed when its parent is killed (-9), before it writes anything."""
import os
import signal
import subprocess
import sys
import textwrap
import time


def test_a_child_dies_with_its_killed_parent(tmp_path):
    marker = tmp_path / "written-after-the-parent-died"
    child = textwrap.dedent(f"""
        import time
        from pipetrain.backend.process.child import die_with_parent
        die_with_parent()
        print("ready", flush=True)
        time.sleep(3)
        open({str(marker)!r}, "w").close()
    """)
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        from pipetrain.backend.process.child import child_env
        child = subprocess.Popen([sys.executable, "-c", {child!r}], env=child_env(), stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "ready\\n"
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child_pid = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + 10
    while _alive(child_pid):
        assert time.monotonic() < end, "the child outlived its parent"
        time.sleep(0.05)
    time.sleep(3.5)
    assert not marker.exists()


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
