"""Shared fixtures: random-initialised model files written once per machine, generated datasets, and
real DeepSpeed runs of the CLI."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomli_w

from pipetrain.backend.commands.demo import make_dataset, write_configs
from pipetrain.backend.process.command_lines import deepspeed_command
from warm_ranks import WarmRanks

REPO = Path(__file__).resolve().parents[1]


# each tier's time (setup, call and teardown of its tests, module and session fixtures included), printed at the end:
# what CI's log shows of where the time goes
_TIER_SECONDS: dict[str, float] = {}


# and the CPU time each test costs (this process, the processes it waited for, and the CPU its live descendants used,
# warm-rank servers and their forked ranks included): unlike wall time, it does not grow when the other worker is
# busy, so it says what a test costs wherever it runs. PIPETRAIN_TEST_COSTS=FILE writes each test's (JSON lines).
_TIER_CPU: dict[str, float] = {}
_PHASE_START: dict[str, float] = {}


def _cpu_seconds() -> float:
    import resource
    total = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))
    tick = os.sysconf("SC_CLK_TCK")
    parents, used = {}, {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents[int(entry.name)] = int(fields[1])
            used[int(entry.name)] = sum(int(f) for f in fields[11:15]) / tick   # utime stime cutime cstime
    me = os.getpid()
    for pid in used:
        ancestor = parents.get(pid)
        while ancestor and ancestor != me:
            ancestor = parents.get(ancestor)
        if ancestor == me:
            total += used[pid]
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    start = _PHASE_START.pop(item.nodeid, None)
    if start is not None:
        report.user_properties.append(("cpu_s", round(_cpu_seconds() - start, 2)))


def _phase_start(item):
    _PHASE_START[item.nodeid] = _cpu_seconds()


pytest_runtest_setup = pytest_runtest_call = pytest_runtest_teardown = _phase_start


def pytest_runtest_logreport(report):
    if report.nodeid.startswith("tests/"):
        tier = report.nodeid.split("/")[1]
        _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration
        cpu = dict(report.user_properties).get("cpu_s", 0.0)
        _TIER_CPU[tier] = _TIER_CPU.get(tier, 0.0) + cpu
        costs = os.environ.get("PIPETRAIN_TEST_COSTS")
        if costs and "PYTEST_XDIST_WORKER" not in os.environ:   # the controller writes each report once
            with open(costs, "a") as f:
                f.write(json.dumps({"test": report.nodeid, "phase": report.when, "wall_s": round(report.duration, 2),
                                    "cpu_s": cpu}) + "\n")


# the order the test files are handed to the workers (scripts/test.sh keeps it: --no-loadscope-reorder): the tiers of
# long files first, so the many short unit files fill the end and no worker is left alone with a long file at the end
_TIER_ORDER = {"server": 0, "ranks": 1, "unit": 2}


@pytest.hookimpl(tryfirst=True)   # before -m deselects: _list_alone_files sees the `alone` tests
def pytest_collection_modifyitems(items):
    def tier(item) -> int:
        parts = item.nodeid.split("/")
        return _TIER_ORDER.get(parts[1], len(_TIER_ORDER)) if len(parts) > 2 and parts[0] == "tests" else 0
    items.sort(key=tier)   # stable: the files of a tier keep their order
    _list_alone_files(items)


# PIPETRAIN_ALONE_FILES=FOLDER: each process that collects writes the test files that hold tests marked `alone` (seen
# before -m deselects them) to FOLDER/<pid>.txt. scripts/test.sh then collects just those files for its `alone`
# phase: collecting the whole suite again to find its 16 tests imported every test module, 16 CPU-s of that phase's
# wall time, before any test ran
ALONE_FILES_ENV = "PIPETRAIN_ALONE_FILES"


def _list_alone_files(items) -> None:
    folder = os.environ.get(ALONE_FILES_ENV)
    if not folder:
        return
    files = sorted({item.nodeid.split("::")[0] for item in items if item.get_closest_marker("alone")})
    out = Path(folder) / f"{os.getpid()}.txt"
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(f"{f}\n" for f in files))
    os.replace(tmp, out)


def pytest_terminal_summary(terminalreporter):
    from comfyui_copies import comfyui_cache, missing_newer_versions, other_comfyuis

    from pipetrain.backend.host.runtime import PINNED_VERSION

    free = shutil.disk_usage(REPO).free / 2**30
    terminalreporter.write_line(f"disk: {free:.1f} GiB free after the tests")
    if _TIER_SECONDS:
        terminalreporter.write_line("time per tier: " + ", ".join(f"{tier} {seconds / 60:.1f} min" for tier, seconds
                                                                  in sorted(_TIER_SECONDS.items())))
        terminalreporter.write_line("CPU time per tier: " + ", ".join(f"{tier} {seconds / 60:.1f} min" for tier, seconds
                                                                      in sorted(_TIER_CPU.items())))
    covered = ", ".join([PINNED_VERSION, *other_comfyuis()])
    terminalreporter.write_line(f"ComfyUI versions covered: {covered}")
    missing = missing_newer_versions()
    if missing:
        terminalreporter.write_line(f"ComfyUI versions skipped (not in {comfyui_cache()}; scripts/comfyui_cache.sh "
                                    f"writes them): {', '.join(missing)}")


@pytest.fixture(scope="module", autouse=True)
def _free_module_temp_dirs(request, tmp_path_factory):
    """Remove the folders a test module made with ``tmp_path_factory`` once the module passed (a passing test's
    own ``tmp_path`` goes at once: ``tmp_path_retention_policy``). The suite writes gigabytes of model files,
    checkpoints and ComfyUI copies, and CI's disk is shared: keeping them all until the end filled it."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for folder in set(base.iterdir()) - before:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_comfy_server(tmp_path_factory):
    """One pinned ComfyUI per test process (a pytest-xdist worker runs a file at a time, so the files it is handed
    share it): a start costs seconds of CPU, and the files that only queue prompts and call routes need no server of
    their own. With the test shims (``server_fixtures.install_test_shims``; no ``simulated_gpus`` file: the real GPU
    count). Tests take it through ``server_fixtures.comfy_server``, which hands each module a clean runs folder; a test
    that restarts, breaks or reconfigures a server starts its own (``server_fixtures.start_server``). Here, not in
    server_fixtures: a session fixture defined in each module that imports it would be one per module."""
    from server_fixtures import install_test_shims, kill_runs, start_server

    # outside the session's temporary folder: ``_free_module_temp_dirs`` removes what a module made there, and
    # the module that first asks for this server is not its only user
    base = Path(tempfile.mkdtemp(prefix="comfy-shared-", dir=tmp_path_factory.getbasetemp().parent))
    try:
        install_test_shims(base)
        server = start_server(base)   # a start that fails says why with the log's tail
        try:
            yield server
        finally:
            server.stop()
            kill_runs(server.runs_root)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def micro_flux_files():
    from pipetrain.backend.models.tiny import cached_model_files
    return cached_model_files("flux", "micro")


@pytest.fixture(scope="session")
def tiny_flux_files():
    from pipetrain.backend.models.tiny import cached_model_files
    return cached_model_files("flux", "tiny")


@pytest.fixture(scope="session")
def tiny_sdxl_files():
    from pipetrain.backend.models.tiny import cached_model_files
    return cached_model_files("sdxl", "tiny")


@pytest.fixture(scope="session")
def flux_diffusers_folder():
    """bench/diffusion_pipe_models.py's tiny Flux pipeline folder (diffusion-pipe's ``diffusers_path``) at the widths
    ComfyUI loads, written once per machine beside the tiny model files (a marker last: a broken write is redone)."""
    pytest.importorskip("diffusers")
    from pipetrain.backend.fsutil import exclusive
    from pipetrain.backend.host.runtime import locate_comfyui
    from pipetrain.backend.models.tiny import tiny_models_root
    from pipetrain.bench.diffusion_pipe_models import write_flux_folder

    folder = tiny_models_root() / "flux-diffusers-comfy-v1"
    with exclusive(folder.with_name(f".{folder.name}.writing")):   # test workers write it once, in turn
        if not (folder / "complete").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            write_flux_folder(folder, "tiny", locate_comfyui(), comfy_widths=True)
            (folder / "complete").write_text("")
    return folder


@pytest.fixture(scope="session")
def model_files():
    """``model_files(arch, size="tiny")``: random-initialised files of any registered architecture, written
    once per machine (``tiny.tiny_models_root``)."""
    from pipetrain.backend.models.tiny import cached_model_files
    return cached_model_files


def micro_flux_with_lora(files):
    """The micro Flux (float32) with LoRA rank 4 (dropout 0.3, B non-zero) in training mode, and probe inputs."""
    import torch

    from pipetrain.backend.adapters import injection
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.backend.parity.verify import probe_inputs

    ensure_comfyui()
    cfg = ModelConfig(type="flux", diffusion_model=str(files.diffusion_model), vae=str(files.vae),
                      text_encoders=[str(p) for p in files.text_encoders], dtype="float32")
    adapter = adapter_class("flux")(cfg)
    adapter.load_diffusion_model()
    dm = adapter.diffusion_model
    injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dropout=0.3, seed=1), adapter.lora_block_prefixes)
    g = torch.Generator().manual_seed(2)
    for m in injection.adapted_modules(dm):
        m.lora_B.weight.data.normal_(0, 0.05, generator=g)
    dm.train()
    return adapter, probe_inputs(adapter)


@dataclass
class Run:
    returncode: int
    output: str
    output_dir: Path

    @property
    def run_dirs(self) -> list[Path]:
        # the shared cache folder keeps a status too (a --cache-only run's): it is not a training run
        return sorted(p for p in self.output_dir.iterdir() if (p / "status.json").exists() and p.name != "cache")

    @property
    def run_dir(self) -> Path:
        return self.run_dirs[-1]

    def events(self, type_: str | None = None) -> list[dict]:
        lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines if line.strip()]
        return [e for e in events if type_ is None or e["type"] == type_]

    def status(self) -> dict:
        return json.loads((self.run_dir / "status.json").read_text())

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.events("step")]

    def loras(self) -> list[Path]:
        return [Path(e["path"]) for e in self.events("lora_saved")]


def launch(config: Path, ranks: int, *extra: str, command: str = "train") -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    import torch
    if ranks > torch.cuda.device_count() > 0:
        env["CUDA_VISIBLE_DEVICES"] = ""   # on a one-GPU machine, a two-stage test trains on CPU ranks as in CI
    return subprocess.Popen(deepspeed_command(command, config, ranks, list(extra)) + ["--no-progress"],
                            cwd=config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


_WARM = WarmRanks()
_REAL_LAUNCH = {"now": False}   # set for the tests marked deepspeed_launcher


def pytest_sessionfinish(session):
    _WARM.close()


@pytest.fixture(autouse=True)
def _launch_kind(request):
    _REAL_LAUNCH["now"] = (request.node.get_closest_marker("deepspeed_launcher") is not None
                           or os.environ.get("PIPETRAIN_TEST_REAL_LAUNCH") == "1")
    yield
    _REAL_LAUNCH["now"] = False


def share_model_files(work: Path, name: str, files) -> None:
    """``bench/run.py``'s ``write_models`` marker ``name`` (its ``models_name``: ``flux-micro``, ``wan-tiny``) under
    ``work``, naming the suite's shared model files: the bench's cases there train on them, writing no copy."""
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{name}.json").write_text(json.dumps({"diffusion_model": str(files.diffusion_model), "vae": str(files.vae),
                                                   "text_encoders": [str(p) for p in files.text_encoders]}))


@pytest.fixture
def warm_bench_ranks(monkeypatch):
    """The bench harness's runs (``bench/ranks.py``, in this process or the harness's subprocesses) fork their ranks
    from the warm server of this environment, as ``train`` does, unless this test launches for real."""
    from pipetrain.bench.ranks import WARM_RANKS_ENV

    if not _REAL_LAUNCH["now"]:
        address = _WARM.address({**os.environ, "PYTHONUNBUFFERED": "1"})
        if address is not None:
            monkeypatch.setenv(WARM_RANKS_ENV, address)


def train(config: Path, ranks: int, *extra: str, timeout: float = 900) -> Run:
    """The CLI's ``train`` on ``ranks`` ranks: forked from a warm server (``warm_ranks.py``) where that is a fair
    copy of a DeepSpeed launch, else (a GPU machine, a test of the launcher) through DeepSpeed's own launcher."""
    return _train(config, ranks, extra, timeout, warm=not _REAL_LAUNCH["now"])


def train_warm(config: Path, ranks: int, *extra: str, timeout: float = 900) -> Run:
    """``train`` forked from warm ranks in a test marked ``deepspeed_launcher`` too: for the runs of a launcher,
    signal or fault test that DeepSpeed's runner plays no part in (an uninterrupted reference run, a run that only
    builds the folder a resume starts from, a fault raised inside a rank). PIPETRAIN_TEST_REAL_LAUNCH=1 and a GPU
    machine still launch for real."""
    return _train(config, ranks, extra, timeout, warm=os.environ.get("PIPETRAIN_TEST_REAL_LAUNCH") != "1")


def train_on_a_thread(config: Path, ranks: int, *extra: str, timeout: float = 900) -> Future:
    """``train_warm`` on a thread of its own, for a test that acts on the run while it trains (a stop file, a control
    request, a run beside another): the future's result is its Run. The warm server runs one run at a time: a test
    waits for this one before its next ``train``."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(train_warm, config, ranks, *extra, timeout=timeout)
    pool.shutdown(wait=False)
    return future


def _train(config: Path, ranks: int, extra: tuple[str, ...], timeout: float, warm: bool) -> Run:
    root = config.parent
    if warm:
        code, out = _forked(["train", str(config), *extra, "--no-progress"], ranks, root,
                            {**os.environ, "PYTHONUNBUFFERED": "1"}, timeout, "training")
        if code is not None:
            return Run(code, out, root / "output")
    return train_launched(config, ranks, *extra, timeout=timeout)


def _forked(argv: list[str], ranks: int, cwd: Path, env: dict[str, str], timeout: float, what: str,
            code: str | None = None) -> tuple[int | None, str]:
    """``WarmRanks.run``: the exit status (None: no warm server fits) and the output."""
    fd, name = tempfile.mkstemp(prefix="pipetrain-warm-ranks-", suffix=".log")
    os.close(fd)
    log = Path(name)
    try:
        status = _WARM.run(argv, ranks, cwd, env, log, timeout, code=code)
        return status, log.read_text(errors="replace")
    except TimeoutError:
        raise AssertionError(f"{what} timed out after {timeout} s\n{log.read_text(errors='replace')[-5000:]}")
    finally:
        log.unlink(missing_ok=True)


def python_child(args: list[str], env: dict[str, str], code: str | None = None,
                 timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m pipetrain ARGS`` (with ``code``: ``python -c CODE ARGS``) in ``env``: forked from the warm server of
    the ComfyUI ``env`` names (``warm_ranks.py``: a fresh process whose imports were paid once), else (a GPU machine)
    a fresh interpreter. Its ``stdout`` holds standard output and error together where it forked: read its last line
    of JSON with ``last_json``."""
    status, out = _forked(list(args), 1, Path.cwd(), env, timeout, "the child", code=code)
    if status is not None:
        return subprocess.CompletedProcess(args, status, out, out)
    argv = ["-c", code, *args] if code is not None else ["-m", "pipetrain", *args]
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env)


def last_json(output: str):
    """The last line of ``output`` that is JSON (a child prints its result last; in a forked child, what it logs on
    standard error may follow)."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise AssertionError(f"no JSON line in the child's output:\n{output[-3000:]}")


def train_launched(config: Path, ranks: int, *extra: str, timeout: float = 900) -> Run:
    """``train`` through DeepSpeed's runner and launcher, always."""
    proc = launch(config, ranks, *extra)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"training timed out after {timeout} s\n{out[-5000:]}")
    root = config.parent
    return Run(proc.returncode, out, root / "output")


@pytest.fixture
def make_run(tmp_path):
    """Write a dataset and a run config into a fresh folder; returns the config path."""
    def _make(files, images: int = 8, name: str = "job", **overrides) -> Path:
        root = tmp_path / name
        make_dataset(root / "dataset", images)
        return write_configs(root, files, **overrides)
    return _make


def eval_set(root: Path) -> dict:
    """Two held-out images (make_dataset's 5th and 6th: other sizes of shapes than the training set's)."""
    make_dataset(root / "eval_images", 6)
    for i in range(4):
        (root / "eval_images" / f"img{i:02d}.png").unlink()
        (root / "eval_images" / f"img{i:02d}.txt").unlink()
    (root / "eval.toml").write_text(tomli_w.dumps({"resolutions": [64], "directory": [{"path": "eval_images"}]}))
    return {"name": "held", "config": str(root / "eval.toml")}


# --- what every model's end-to-end test checks ------------------------------------------------------------
MATCH_TOLERANCE = 1e-4   # ComfyUI's LoRA output vs the training side's, float32 both sides
MIN_EFFECT = 1e-3        # the LoRA must change the output


def check_epoch_loras(run: Run, config: Path, keys: int, last_only: bool = False) -> None:
    """Every saved LoRA (or the last one: a first epoch of two steps may barely move) loads in ComfyUI (``keys``
    modules patched), reproduces the training side and has an effect."""
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.parity.verify import check_loras

    cfg = load_run_config(config)
    assert run.loras()
    paths = run.loras()[-1:] if last_only else run.loras()
    checks = check_loras(cfg, paths)
    assert len(checks) == len(paths)
    for check in checks:
        assert check.keys_loaded == keys
        assert check.comfy_vs_training < MATCH_TOLERANCE * max(1.0, check.scale)
        assert check.lora_effect > MIN_EFFECT


def add_control_images(config: Path, folders: int = 1) -> Path:
    """An edit run's control images: each dataset picture in grey, paired by file stem in ``controls/`` beside
    the dataset (named in its [[directory]] table); with ``folders`` > 1 also mirrored copies in ``controls2/``,
    ... (control_path then lists the folders in order). Returns the run's folder."""
    from PIL import Image, ImageOps

    root = config.parent
    names = ["controls"] + [f"controls{k}" for k in range(2, folders + 1)]
    for k, name in enumerate(names):
        (root / name).mkdir()
        for image in sorted((root / "dataset").glob("*.png")):
            picture = ImageOps.grayscale(Image.open(image)).convert("RGB")
            (ImageOps.mirror(picture) if k % 2 else picture.rotate(90 * k)).save(root / name / f"{image.stem}.jpg")
    paths = [str(root / name) for name in names]
    with open(root / "dataset.toml", "a") as f:   # lands in the [[directory]] table
        f.write(f"control_path = {json.dumps(paths[0] if folders == 1 else paths)}\n")
    return root


def train_on_clips(files, root: Path, arch: str, epochs: int = 1, frame_buckets=(1, 9, 17), **model) -> tuple[Run, Path]:
    """A video model on generated clips (mp4, webm, gif, animated WebP) and two stills, 2 ranks as a 2-stage
    pipeline; returns the finished run and its config."""
    from media import make_video_dataset

    make_video_dataset(root / "dataset")
    config = write_configs(root, files, stages=2, epochs=epochs, model={"type": arch, **model})
    with open(root / "dataset.toml", "a") as f:   # lands in the [[directory]] table: per-directory buckets
        f.write(f"frame_buckets = {list(frame_buckets)}\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert run.events("cached")[0]["latents_encoded"] == 6                 # 4 clips, 2 images
    return run, config


def cached_latents(root: Path, arch: str) -> dict[str, tuple[tuple, tuple]]:
    """File name -> (bucket, cached latent shape) of a run's dataset."""
    from pipetrain.backend.cache import CacheStore
    from pipetrain.backend.cache.manifest import CacheManifest

    cache = root / "output" / "cache"
    store = CacheStore(cache)
    entries = CacheManifest.load(next(cache.glob(f"manifests/{arch}-*"))).entries
    return {e.path.rsplit("/", 1)[-1]: (e.bucket, tuple(store.get("latents", e.latent)["latent"].shape))
            for e in entries}
