"""Where the host's time goes in a step: the main thread's Python stack, sampled from a second thread.

torch.profiler shows operators, and the time it adds to each one hides how long the Python around them takes;
when the GPU waits for the host (a step longer than its kernels), the question is which Python code the host
was in. ``HostSampler`` reads ``sys._current_frames()`` every ``interval_s`` and adds, per function, the time
since its previous look to the functions on the stack (inclusive) and to the line the stack ended at (where the
host actually was, a C call counting to the Python line that made it). Weighting by the time elapsed, not by
counting samples, keeps the shares right when the sampler itself is delayed (a busy machine, a main thread
that holds the GIL). Nothing is instrumented, but the short GIL switch interval
the sampler needs slows the host measurably: read the shares, not the times.
"""
from __future__ import annotations

import collections
import sys
import threading
import time

_TRIM = ("site-packages/", "ComfyUI/", "pipetrain/", "lib/python")


def _short(filename: str) -> str:
    for marker in _TRIM:
        at = filename.rfind(marker)
        if at >= 0:
            return filename[at + len(marker):] if marker != "lib/python" else filename[at:]
    return filename


class HostSampler:
    """``with HostSampler() as s: ...`` samples the thread that entered it; ``s.report(wall_s, steps)`` after."""

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s = interval_s
        self.samples = 0
        self.inclusive: collections.Counter[str] = collections.Counter()   # key -> seconds
        self.lines: collections.Counter[str] = collections.Counter()
        self._target: int | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch_interval = sys.getswitchinterval()

    def __enter__(self) -> "HostSampler":
        self._target = threading.get_ident()
        self._switch_interval = sys.getswitchinterval()
        # the sampler needs the GIL to look; the main thread otherwise keeps it for up to 5 ms at a time
        sys.setswitchinterval(min(self._switch_interval, self.interval_s / 2))
        self._thread = threading.Thread(target=self._run, name="pipetrain-host-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        sys.setswitchinterval(self._switch_interval)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._done.wait(self.interval_s):
            frame = sys._current_frames().get(self._target)
            now = time.perf_counter()
            elapsed, last = now - last, now
            if frame is None:
                continue
            self.samples += 1
            code = frame.f_code
            self.lines[f"{_short(code.co_filename)}:{frame.f_lineno} {code.co_name}"] += elapsed
            seen = set()
            while frame is not None:
                code = frame.f_code
                key = f"{_short(code.co_filename)}:{code.co_firstlineno} {code.co_name}"
                if key not in seen:
                    seen.add(key)
                    self.inclusive[key] += elapsed
                frame = frame.f_back

    def report(self, wall_s: float, steps: int, top: int = 40) -> str:
        """Functions by inclusive time and lines by time spent at them, in ms per step."""
        per_step = 1e3 / max(steps, 1)
        out = [f"{self.samples} samples over {steps} steps, {wall_s * 1e3 / max(steps, 1):.1f} ms a step", "",
               "ms/step  function (inclusive)"]
        out += [f"{n * per_step:7.1f}  {key}" for key, n in self.inclusive.most_common(top)]
        out += ["", "ms/step  line the host was at"]
        out += [f"{n * per_step:7.1f}  {key}" for key, n in self.lines.most_common(top)]
        return "\n".join(out) + "\n"
