"""Warm ranks: the model runs of the test suite without paying for four fresh interpreters each.

A DeepSpeed launch on CPU starts DeepSpeed's runner, its ``launch.py`` and one interpreter per rank, each importing
torch and DeepSpeed, and each rank then imports ComfyUI: most of a tiny run's time goes there. Here one server
process per ComfyUI imports all of that once and forks the ranks of each run from itself: each rank is a fresh
process (nothing of one run reaches the next), with the environment DeepSpeed's ``launch.py`` gives a rank, the same
argv (``--local_rank=N`` first) and the same entry (``pipetrain.backend.cli.main``); the run waits on its ranks as
``launch.py`` does (one failing rank ends the others, and its exit status is the run's).

What it leaves out is what DeepSpeed's runner and launcher do, so the runs that a test of the launcher, of signals,
of multi-node set-ups, of faults or of resume signals or kills from outside keep real launches (``conftest.launch``,
``conftest.train_launched``, or the ``deepspeed_launcher`` marker); their other runs (a reference, a fault raised
inside a rank, a resume) fork from here too (``conftest.train_warm``).
A run whose config is trained by another ComfyUI than the one its environment names (the pinned copy in place of the
host's, ``backend/parity/fallback.py``) forks from the server of the ComfyUI that trains it, as a launch's rank imports
that one; any machine with a GPU launches for real (CUDA must not start before a fork).

A test's child process that imports a ComfyUI (a ``doctor``, a LoRA check in that ComfyUI's loader) forks from that
ComfyUI's server too (``WarmRanks.run`` with ``code``, ``conftest.python_child``): a fresh process with the imports
paid once.

The bench harness's runs (``bench/ranks.py``) reach a server through the Unix socket it listens on
(``WarmRanks.address``, passed to the harness as ``PIPETRAIN_BENCH_WARM_RANKS``): the same requests and answers, one
run a connection, refused where the run's start environment is not the server's.

Run as a script, this file is the server: JSON requests on stdin (or the socket named by its argument), JSON answers
on stdout (or that connection)."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# a rank's exit status when the config needs another ComfyUI than the one this server imported: run it for real
OTHER_COMFYUI = 97
_GRACE_S = 10.0
_MAX_SERVERS = 3   # the other ranks' time to end after one failed, before they are killed


# --- the client: the test process ------------------------------------------------------------------------------
# what an interpreter reads of its environment as it starts, before a rank's code runs: a run whose environment
# differs in these gets a server of its own
_START_ENV = ("COMFYUI_PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE")


class WarmRanks:
    """One server per start environment (``_START_ENV``: the ComfyUI a run's environment names, its Python path),
    started at first use. One run at a time: a run asked for on another thread (``conftest.train_on_a_thread``)
    waits for the one going on."""

    def __init__(self):
        self._one_at_a_time = threading.Lock()
        self._servers: dict[str, subprocess.Popen] = {}
        self._unfit: set[str] = set()   # start environments whose server said forking is no fair copy (a GPU)

    def run(self, argv: list[str], ranks: int, cwd: Path, env: dict[str, str], log: Path,
            timeout: float, code: str | None = None) -> int | None:
        """Runs ``pipetrain ARGV`` on ``ranks`` forked ranks (with ``code``: ``python -c CODE ARGV`` in one forked
        process), their output into ``log``; returns the exit status as DeepSpeed's runner would give it, or None
        where this run needs a real launch."""
        with self._one_at_a_time:
            return self._run(argv, ranks, cwd, env, log, timeout, code)

    def _run(self, argv: list[str], ranks: int, cwd: Path, env: dict[str, str], log: Path,
             timeout: float, code: str | None) -> int | None:
        other = _trained_by_another_comfyui(argv, env)
        if other is not None:   # a launched rank takes this decision (memoised) and imports that ComfyUI: its server
            from pipetrain.backend.parity.fallback import CHOICE_ENV

            # the ranks are told the decision, as a parent process tells its children: a fork finds the ComfyUI its
            # server imported, where a fresh rank finds the host named by COMFYUI_PATH and decides
            env = {**env, CHOICE_ENV: json.dumps(other.event())}
        server = self._server({**env, "COMFYUI_PATH": other.path} if other is not None else env)
        if server is None:
            return None
        request = {"argv": argv, "ranks": ranks, "cwd": str(cwd), "env": env, "log": str(log), "code": code}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        group = self._answer(server, 60.0)["group"]
        try:
            status = self._answer(server, timeout)["returncode"]
        except TimeoutError:
            os.killpg(group, signal.SIGKILL)
            self._answer(server, 60.0)
            raise
        return None if status == OTHER_COMFYUI else status

    def address(self, env: dict[str, str]) -> str | None:
        """The socket of the server for ``env`` (started if need be), for runs started by another process (the bench
        harness's); None where forking is no fair copy of a launch here."""
        server = self._server(env)
        return server.address if server is not None else None

    def close(self) -> None:
        for server in self._servers.values():
            _close(server)
        self._servers.clear()

    def _server(self, env: dict[str, str]) -> subprocess.Popen | None:
        key = _start_key(env)
        if key in self._unfit:
            return None
        server = self._servers.pop(key, None)
        if server is not None and server.poll() is None:
            self._servers[key] = server   # the most recently used last
            return server
        while len(self._servers) >= _MAX_SERVERS:   # each holds a ComfyUI's worth of memory
            _close(self._servers.pop(next(iter(self._servers))))
        address = os.path.join(tempfile.mkdtemp(prefix="pipetrain-warm-ranks-"), "socket")
        server = subprocess.Popen([sys.executable, "-u", __file__, address], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parent)
        server.address = address
        if env.get("PIPETRAIN_TEST_COSTS"):   # how often a test run pays for a server's start (conftest's costs)
            with open(env["PIPETRAIN_TEST_COSTS"], "a") as f:
                f.write(json.dumps({"warm_server": {name: env.get(name, "") for name in _START_ENV}}) + "\n")
        try:
            ready = self._answer(server, 300.0)
        except (TimeoutError, ConnectionError):
            server.kill()
            raise
        if not ready.get("ready"):
            server.kill()
            self._unfit.add(key)
            return None
        self._servers[key] = server
        return server

    @staticmethod
    def _answer(server: subprocess.Popen, timeout: float) -> dict:
        if not select.select([server.stdout], [], [], timeout)[0]:
            raise TimeoutError(f"the warm-ranks server did not answer within {timeout:.0f} s")
        line = server.stdout.readline()
        if not line:
            raise ConnectionError(f"the warm-ranks server ended (exit status {server.wait()})")
        return json.loads(line)


def _start_key(env: dict[str, str]) -> str:
    """What tells servers apart: ``_START_ENV``, the ComfyUI by the folder it resolves to (none named: the one this
    process finds), so a run trained by the pinned copy shares the server of the runs that name none."""
    from pipetrain.backend.host.runtime import _candidates, is_comfyui

    named = env.get("COMFYUI_PATH")
    # none named: the one a fresh process finds (not the one this process may have imported)
    found = [path for origin, path in _candidates() if origin != "COMFYUI_PATH" and is_comfyui(path)]
    comfyui = str(Path(named).resolve() if named else found[0].resolve() if found else "")
    return "\0".join([comfyui, *(env.get(name, "") for name in _START_ENV if name != "COMFYUI_PATH")])


def _trained_by_another_comfyui(argv: list[str], env: dict[str, str]):
    """The decision (``fallback.ComfyChoice``) of a run whose environment names a ComfyUI (COMFYUI_PATH) that another
    one trains (the pinned copy in place of the host's), else None."""
    host = env.get("COMFYUI_PATH")
    chosen = _chosen_comfyui(argv, Path(host)) if host else None
    if chosen is None or chosen.refused or Path(chosen.path).resolve() == Path(host).resolve():
        return None
    return chosen


def _chosen_comfyui(argv: list[str], host: Path | None = None):
    """The ComfyUI that trains a ``train`` or ``cache`` run's config (``backend/parity/fallback.py`` decides, without
    importing a ComfyUI, remembering its verdict for the run); None for other commands and configs the CLI refuses
    (a rank says why)."""
    if len(argv) < 2 or argv[0] not in ("train", "cache"):
        return None
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.parity.fallback import choose_comfyui
    try:
        return choose_comfyui(load_run_config(Path(argv[1])).model.type, host=host)
    except Exception:
        return None


def _close(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    shutil.rmtree(Path(server.address).parent, ignore_errors=True)


# --- the server --------------------------------------------------------------------------------------------------
def _warm_up() -> bool:
    """Imports what every rank imports before its work. False where forking ranks would not be a fair copy of a
    launch (a GPU: CUDA cannot cross a fork)."""
    import torch
    if torch.cuda.is_available():
        return False
    import deepspeed  # noqa: F401
    import deepspeed.runtime.pipe.engine  # noqa: F401

    import pipetrain.backend.cli  # noqa: F401
    import pipetrain.backend.train.trainer  # noqa: F401
    from pipetrain.backend.models.registry import ADAPTERS, adapter_class
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    import comfy.sd  # noqa: F401  (ComfyUI's loaders and with them its model code)
    # what every rank imports later, on its way through a run: each rank would import it again after the fork
    for name in ADAPTERS:
        adapter_class(name)
    import pipetrain.backend.cache.builder  # noqa: F401
    import pipetrain.backend.data.audio  # noqa: F401
    import pipetrain.backend.data.video  # noqa: F401
    import pipetrain.backend.parity.check  # noqa: F401
    import pipetrain.backend.train.epoch_samples  # noqa: F401
    import pipetrain.backend.preflight  # noqa: F401
    import pipetrain.backend.sampling.render  # noqa: F401
    import pipetrain.backend.train.caching  # noqa: F401
    import pipetrain.backend.train.engine  # noqa: F401
    import pipetrain.backend.train.loop  # noqa: F401
    import torch._dynamo  # noqa: F401  (the engine's backward and checkpointing reach torch.compile's machinery)
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401  (the events' TensorBoard writer)
    import deepspeed.module_inject  # noqa: F401  (DeepSpeed's engine reaches it as it starts)
    import deepspeed.moe.ep_router  # noqa: F401
    from PIL import Image
    Image.init()   # the image formats' plugins, loaded at a dataset's first read
    return True


def _same_comfyui(argv: list[str]) -> bool:
    """Whether the ComfyUI that trains this config is the one imported here."""
    from pipetrain.backend.host.runtime import _already_imported
    chosen = _chosen_comfyui(argv)
    return chosen is None or Path(chosen.path).resolve() == _already_imported()


def _rank(argv: list[str], local_rank: int, ranks: int, port: int, request: dict, log_fd: int) -> None:
    """In the forked child: become rank ``local_rank`` of a ``ranks``-rank DeepSpeed launch and run. Never returns."""
    code = 1
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.stdout.reconfigure(line_buffering=True)   # python -u, as DeepSpeed's launch.py starts ranks
        sys.stderr.reconfigure(line_buffering=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks), CROSS_RANK="0",
                          CROSS_SIZE="1", LOCAL_SIZE=str(ranks), RANK=str(local_rank), LOCAL_RANK=str(local_rank))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if request.get("code") is not None:   # a test's child process, not a rank (``conftest.python_child``)
            sys.argv = ["-c", *argv]
            try:
                exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        elif not _same_comfyui(argv):
            code = OTHER_COMFYUI
        else:
            from pipetrain.backend.cli import main
            from pipetrain.backend.process.command_lines import ENTRY
            sys.argv = [str(ENTRY), f"--local_rank={local_rank}", *argv]
            try:
                code = main(sys.argv[1:])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            import threading
            threading._shutdown()   # an interpreter's exit waits for its non-daemon threads
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    try:
        from pipetrain.backend.train.distributed import end_process
        end_process(code & 0xFF)   # atexit handlers, the streams, then out (a finished rank's own way out)
    finally:
        os._exit(code & 0xFF)   # a forked rank never returns into the server


def _launch(request: dict, answers, peer: socket.socket | None = None) -> int:
    """One run: fork its ranks into one process group (the client's timeout kills that group), wait as DeepSpeed's
    ``launch.py`` does. With ``peer`` (a socket's client), the ranks are killed if it goes away."""
    from pipetrain.backend.process.command_lines import free_port

    ranks, argv, port = int(request["ranks"]), list(request["argv"]), free_port()
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    answers.flush()
    pids: list[int] = []
    for local_rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, pids[0] if pids else 0)
            for inherited in _SOCKETS:   # a rank holds no connection of the server's open
                os.close(inherited.fileno())
            _rank(argv, local_rank, ranks, port, request, log_fd)
        try:   # in the parent too: the group exists before either process goes on
            os.setpgid(pid, pids[0] if pids else pid)
        except OSError:
            pass
        pids.append(pid)
    os.close(log_fd)
    print(json.dumps({"group": pids[0]}), file=answers, flush=True)
    alive, failed = set(pids), None
    killed_at = None
    while alive:
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                if code != 0 and failed is None:
                    failed = code
        if peer is not None and alive and _hung_up(peer):   # the client was killed: its run goes with it
            _signal(alive, signal.SIGKILL)
            peer = None
        if failed is not None and alive:
            if killed_at is None:   # DeepSpeed's launch.py ends the other ranks of a failed one
                killed_at = time.monotonic()
                _signal(alive, signal.SIGTERM)
            elif time.monotonic() - killed_at > _GRACE_S:
                _signal(alive, signal.SIGKILL)
        time.sleep(0.05)
    if failed is None:
        return 0
    if failed == OTHER_COMFYUI:
        return OTHER_COMFYUI
    return failed if failed > 0 else 256 + failed   # sys.exit(-6) in launch.py: 250


def _signal(pids, signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _hung_up(peer: socket.socket) -> bool:
    try:
        return peer.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# the listening socket and the connection being served: closed in each forked rank
_SOCKETS: list[socket.socket] = []


def _serve_connection(conn: socket.socket, start_env: dict[str, str]) -> None:
    """One run requested through the socket (``bench/ranks.py``): its group, then its exit status, on the
    connection; a run whose start environment differs from this server's gets no group (it launches for real)."""
    _SOCKETS.append(conn)
    try:
        with conn, conn.makefile("rw", buffering=1) as stream:
            request = json.loads(stream.readline() or "null")
            if not isinstance(request, dict):
                return
            differs = [name for name in _START_ENV if request["env"].get(name, "") != start_env[name]]
            if differs:
                stream.write(json.dumps({"group": None, "why": f"{', '.join(differs)} differ"}) + "\n")
                return
            stream.write(json.dumps({"returncode": _launch(request, stream, conn)}) + "\n")
    except OSError:   # the client went away
        pass
    finally:
        _SOCKETS.remove(conn)


def serve(address: str | None = None) -> None:
    # the answers get standard output's pipe to themselves: what ComfyUI and others print goes to standard error
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    start_env = {name: os.environ.get(name, "") for name in _START_ENV}
    from pipetrain.backend.process.command_lines import ENTRY
    sys.path[0] = str(ENTRY.parent)   # a rank runs the entry file by its path: its folder comes first, not tests/
    ready = _warm_up()
    listener = None
    if ready and address:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen()
        _SOCKETS.append(listener)
    print(json.dumps({"ready": ready}), file=answers, flush=True)
    if not ready:
        return
    # one run at a time: a client waits for its answer before it asks again
    while True:
        readable = select.select([sys.stdin, *([listener] if listener else [])], [], [])[0]
        if listener in readable:
            _serve_connection(listener.accept()[0], start_env)
        if sys.stdin in readable:
            line = sys.stdin.readline()
            if not line:
                return
            print(json.dumps({"returncode": _launch(json.loads(line), answers)}), file=answers, flush=True)


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else None)
