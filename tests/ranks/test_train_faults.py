"""Faults with real DeepSpeed ranks. The kill schedule: a run killed (SIGKILL, the whole process group) at
each point where it saves or renames a file, then resumed: every file under a final name loads, no temporary
file or duplicate is left, and the epoch LoRAs equal an uninterrupted run's bit for bit. The kills come from
``fsutil.fault_point`` (PIPETRAIN_KILL_AT), which stops the run exactly between two writes. Also: one live
writer per run folder, ranks that end with their launcher, and a full disk (a small tmpfs; needs root).

A fault point kills its own process group: with DeepSpeed's launcher that is the runner, its launch.py and the ranks,
with warm ranks (``conftest.train_warm``) the ranks alone. Only the ranks write into a run folder, so the runs that a
test does not signal from outside (reference runs, faults raised in a rank, resumes) fork from warm ranks, and the
first kill of each schedule goes through DeepSpeed's launcher."""
import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import eval_set, launch, train_launched, train_on_a_thread, train_warm
from safetensors.torch import load_file

from pipetrain.backend.fsutil import FULL_AT_ENV, KILL_AT_ENV
from pipetrain.backend.train.peer_watch import SILENCE_ENV

# 4 images, global batch 1: epoch 1 is steps 1-4, epoch 2 steps 5-8; a LoRA, then a checkpoint, after each epoch
SETUP = dict(stages=2, epochs=2, checkpoint_every_n_epochs=1, lr_scheduler="cosine", warmup_steps=2,
             optimizer={"type": "adamw", "lr": 5e-3})

# One run folder, killed again at the next point by each resume. The comment says what the kill leaves.
KILLS = [
    ("", "lora-written:1"),               # epoch 1's LoRA as a .tmp file, no checkpoint: starts over
    ("resume", "lora-renamed:1"),         # epoch 1's LoRA in place, no checkpoint: starts over, rewrites it in place
    ("resume", "checkpoint-written:1"),   # step 4 written into its partial folder, not renamed: starts over
    ("resume", "checkpoint-latest:1"),    # step 4 and `latest` in place, nothing else done
    ("resume", "checkpoint-renamed:1"),   # step 8 in place, `latest` still names step 4: epoch 2 again
    ("resume", "checkpoint-aside:1"),     # the first step 8 moved aside, its replacement complete but not in place
    ("resume", "checkpoint-latest:1"),    # (step 8 back from aside) step 8 replaced and named by `latest`, the old
                                          # one not yet removed; epoch 2's LoRA rewritten in place each time
]


def _run(config, kill_at="", resume=False, launched=False):
    env_before = os.environ.get(KILL_AT_ENV)
    os.environ[KILL_AT_ENV] = kill_at
    try:
        return (train_launched if launched else train_warm)(config, 2, *(["--resume", "chain"] if resume else []))
    finally:
        if env_before is None:
            os.environ.pop(KILL_AT_ENV)
        else:
            os.environ[KILL_AT_ENV] = env_before


def _check_final_names(run_dir):
    """Everything under a final name is whole: LoRAs load, checkpoints are complete, ``latest`` (when there)
    names one; no epoch LoRA has a copy."""
    loras = sorted(p.name for p in (run_dir / "loras").glob("*.safetensors")) if (run_dir / "loras").is_dir() else []
    for name in loras:
        load_file(str(run_dir / "loras" / name))
    assert all(name in ("chain-epoch0001.safetensors", "chain-epoch0002.safetensors") for name in loras), loras
    ckpts = run_dir / "checkpoints"
    for d in ckpts.glob("step*"):
        assert (d / "pipetrain.json").is_file(), f"{d} is under a final name but incomplete"
    if (ckpts / "latest").exists():
        assert (ckpts / (ckpts / "latest").read_text().strip() / "pipetrain.json").is_file()


@pytest.mark.slow
def test_kill_at_every_save_point_then_resume(micro_flux_files, make_run):
    reference = train_warm(make_run(micro_flux_files, images=4, name="reference", **SETUP), ranks=2)
    assert reference.returncode == 0, reference.output[-3000:]
    assert [e["step"] for e in reference.events("checkpoint")] == [4, 8]    # the last step is saved once

    config = make_run(micro_flux_files, images=4, name="killed", run_name="chain", **SETUP)
    run_dir = config.parent / "output" / "chain"
    for n, (resume, kill_at) in enumerate(KILLS):
        killed = _run(config, kill_at, resume=bool(resume), launched=n == 0)
        assert killed.returncode != 0, f"{kill_at} was never reached:\n{killed.output[-3000:]}"
        _check_final_names(run_dir)
        assert json.loads((run_dir / "status.json").read_text())["state"] != "finished", kill_at

    resumed = _run(config, resume=True)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.status()["state"] == "finished"
    assert resumed.events("resume")[-1]["step"] == 8            # the last kill came after step 8's checkpoint
    _check_final_names(run_dir)
    leftovers = [p.name for p in run_dir.rglob(".*") if p.name != ".lock"]
    assert leftovers == [], leftovers                          # temporary files and folders swept
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step00000004", "step00000008"]
    assert [entry["epoch"] for entry in resumed.status()["loras"]] == [1, 2]

    for epoch, expected in enumerate(reference.loras(), 1):
        got = load_file(str(run_dir / "loras" / f"chain-epoch{epoch:04d}.safetensors"))
        want = load_file(str(expected))
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (epoch, key)


def _checkpoint(root, step):
    folder = root / f"step{step:08d}"
    folder.mkdir(parents=True)
    (folder / "pipetrain.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    from pipetrain.backend.train.checkpoint import latest_tag

    _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 3)
    (tmp_path / "step00000005").mkdir()                       # renamed in before its completion mark: never
    (tmp_path / "latest").write_text("step00000009")          # a folder a killed save deleted
    assert latest_tag(tmp_path) == "step00000003"
    (tmp_path / "latest").write_text("step00000002")          # a complete one named: it wins
    assert latest_tag(tmp_path) == "step00000002"
    (tmp_path / "latest").unlink()                            # killed before the first `latest` was written
    assert latest_tag(tmp_path) == "step00000003"


def test_sweep_restores_a_checkpoint_moved_aside(tmp_path):
    from pipetrain.backend.train.checkpoint import sweep

    _checkpoint(tmp_path, 4)
    aside = _checkpoint(tmp_path, 8).rename(tmp_path / ".old-step00000008")
    (tmp_path / ".partial-step00000008").mkdir()
    sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000004", "step00000008"]
    assert not aside.exists()


def _rank_pids(config):
    """Live training ranks of a run: DeepSpeed's launch.py starts each with ``--local_rank=N`` and the config."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(config).encode() in argv and any(a.startswith(b"--local_rank=") for a in argv) and state != "Z":
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_one_writer_per_run_folder_and_ranks_end_with_their_launcher(micro_flux_files, make_run):
    config = make_run(micro_flux_files, images=4, name="busy", run_name="busy", stages=2, epochs=10000,
                      save_every_n_epochs=1000, checkpoint_every_n_epochs=1000)
    run_dir = config.parent / "output" / "busy"
    first = launch(config, 2)
    try:
        _wait_for(lambda: (run_dir / "events.jsonl").is_file() and '"step"' in (run_dir / "events.jsonl").read_text())
        owner = json.loads((run_dir / "status.json").read_text())["pid"]
        for extra in ([], ["--resume", "busy"]):              # the same run_name again, or a resume meanwhile
            second = train_warm(config, 2, *extra)
            assert second.returncode != 0
            assert f"run folder {run_dir} is in use by a run that is still going (pid {owner})" in second.output
        assert json.loads((run_dir / "status.json").read_text())["state"] == "training"   # untouched

        ranks = _rank_pids(config)
        assert len(ranks) == 2 and owner in ranks
        os.kill(first.pid, signal.SIGKILL)                     # DeepSpeed's runner only: the ranks are orphaned
        _wait_for(lambda: not _rank_pids(config), timeout=30)
        status = json.loads((run_dir / "status.json").read_text())
        assert status["state"] == "failed" and "DeepSpeed launcher" in status["error"]
        _wait_for(lambda: _lock_is_free(run_dir), timeout=30)   # the dead run's lock went with it
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:   # every process of the run has ended
            pass
        first.communicate()


def _lock_is_free(run_dir):
    from pipetrain.backend.run.folder import RunDir, RunDirBusy
    try:
        RunDir(run_dir).lock().close()
    except RunDirBusy:   # a process's files close a moment after its command line is gone
        return False
    return True


def _wait_for(condition, timeout=300):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.2)


@contextlib.contextmanager
def _small_disk(folder: Path, size: str):
    """A tmpfs of ``size`` mounted at ``folder`` (root only: skips elsewhere)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["cache", "loras", "checkpoints"])
def test_out_of_space_names_the_folder_fails_the_run_and_leaves_no_partial_files(micro_flux_files, make_run, where):
    config = make_run(micro_flux_files, images=4, name=f"full-{where}", run_name="full", **{**SETUP, "epochs": 1})
    output = config.parent / "output"
    folder = output / "cache" if where == "cache" else output / "full" / where
    with _small_disk(folder, "256k"):
        run = train_warm(config, 2)
        left = sorted(p.name for p in folder.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp")
    assert run.returncode != 0
    assert f"pipetrain: error: no space left in {folder}" in run.output
    assert "Traceback" not in run.output, run.output[run.output.find("Traceback") - 2000:][:6000]
    status = json.loads((output / "full" / "status.json").read_text())
    assert status["state"] == "failed" and status["error"].startswith(f"no space left in {folder}")
    assert left == []                                          # no .tmp, no .partial-step…


class _Payload:
    """A pickle that runs code when unpickled: it leaves a file behind."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.slow
def test_damaged_or_planted_checkpoint_is_not_resumed(micro_flux_files, make_run, tmp_path):
    """A pickle planted in a checkpoint (its digest updated too, as one who can write the folder could) is refused
    by name before it runs; one flipped byte in the newest checkpoint's layer file makes the resume fall back to the
    previous checkpoint, saying so, and end with the uninterrupted run's LoRA; a damaged latent and a cut text
    entry in the cache are encoded again, each with a warning naming its file."""
    config = make_run(micro_flux_files, images=4, name="tampered", run_name="chain", **SETUP)
    first = _run(config, "checkpoint-latest:2")               # step 8 saved, killed before the run finished
    assert first.returncode != 0, first.output[-3000:]
    assert (first.run_dir / "checkpoints" / "latest").read_text() == "step00000008"
    lora = first.run_dir / "loras" / "chain-epoch0002.safetensors"
    want = load_file(str(lora))
    newest = first.run_dir / "checkpoints" / "step00000008"
    layer = sorted(newest.glob("layer_*-model_states.pt"))[1]
    original = layer.read_bytes()

    marker = tmp_path / "code-ran"
    torch.save(_Payload(str(marker)), layer)
    digests = json.loads((newest / "digests.json").read_text())
    digests[layer.name] = {"bytes": layer.stat().st_size,
                           "sha256": hashlib.sha256(layer.read_bytes()).hexdigest()}
    (newest / "digests.json").write_text(json.dumps(digests))
    planted = _run(config, resume=True)
    assert planted.returncode != 0
    assert not marker.exists()
    assert f"{layer} holds more than tensors and plain values" in planted.status()["error"]

    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x10
    layer.write_bytes(bytes(damaged))
    digests[layer.name] = {"bytes": len(original), "sha256": hashlib.sha256(original).hexdigest()}
    (newest / "digests.json").write_text(json.dumps(digests))
    cache = config.parent / "output" / "cache"
    latent = sorted((cache / "latents").rglob("*.safetensors"))[0]
    text = sorted((cache / "text").rglob("*.safetensors"))[0]
    flipped = bytearray(latent.read_bytes())
    flipped[-3] ^= 0x01                                        # the cache too: a damaged latent, a cut text entry
    latent.write_bytes(bytes(flipped))
    text.write_bytes(text.read_bytes()[:-64])
    resumed = _run(config, resume=True)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"cache entry {latent} differs from what was encoded" in resumed.output
    assert f"cache entry {text} cannot be read" in resumed.output
    assert resumed.events("resume")[-1]["checkpoint"] == "step00000004"
    assert [e["checkpoint"] for e in resumed.events("warning") if "checkpoint" in e] == ["step00000008"]
    got = load_file(str(lora))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


SAMPLES = {"prompts": ["a red circle"], "seed": 3, "width": 64, "height": 64, "steps": 2}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["cache-rank1", "samples"])
def test_out_of_space_on_another_rank_or_in_the_sample_renderer_fails_the_run_naming_the_folder(
        micro_flux_files, make_run, where, monkeypatch):
    """The OS's ENOSPC raised where the bytes are written (``fsutil.fault_point``, PIPETRAIN_FULL_AT): on rank 1
    while it caches (rank 0 only loses contact with it), or in the child process that renders the samples."""
    extra = {"samples": SAMPLES} if where == "samples" else {}
    config = make_run(micro_flux_files, images=4, name=f"full-{where}", run_name="full", **{**SETUP, "epochs": 1},
                      **extra)
    output = config.parent / "output"
    folder = output / "cache" if where == "cache-rank1" else output / "full" / "loras"
    monkeypatch.setenv(FULL_AT_ENV, "cache-written:latents:1@1" if where == "cache-rank1" else "sample-written:1")
    run = train_warm(config, 2)
    assert run.returncode != 0
    status = json.loads((output / "full" / "status.json").read_text())
    assert status["state"] == "failed" and status["error"].startswith(f"no space left in {folder}:"), status
    assert "lost contact" not in status["error"]
    assert "Traceback" not in run.output, run.output[run.output.find("Traceback") - 2000:][:6000]
    left = sorted(p.name for p in folder.rglob("*") if p.suffix == ".tmp")
    assert left == []


@pytest.mark.slow
def test_an_eval_killed_after_its_epoch_is_done_again_on_resume(micro_flux_files, make_run, tmp_path):
    """Killed in the middle of epoch 1's eval (which came after that epoch's checkpoint): the resume evaluates step
    4 again rather than going on from the checkpoint as if the eval had run."""
    config = make_run(micro_flux_files, images=4, name="evals", run_name="chain", **SETUP,
                      eval_datasets=[eval_set(tmp_path / "evals")], eval_every_n_epochs=1,
                      eval_before_first_step=False)
    killed = _run(config, "eval-batch:1")
    assert killed.returncode != 0, killed.output[-3000:]
    assert killed.events("eval") == []
    resumed = _run(config, resume=True)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [e["step"] for e in resumed.events("eval")] == [4, 8]


@pytest.mark.slow
def test_a_resume_on_a_dataset_with_pictures_deleted_says_so_and_trains_on_the_rest(micro_flux_files, make_run):
    config = make_run(micro_flux_files, images=4, name="shrunk", run_name="chain", **SETUP)
    killed = _run(config, "checkpoint-latest:1")              # epoch 1 (steps 1-4) saved
    assert killed.returncode != 0, killed.output[-3000:]
    dataset = config.parent / "dataset"
    for name in ("img00", "img01"):
        (dataset / f"{name}.png").unlink()
        (dataset / f"{name}.txt").unlink()
    resumed = _run(config, resume=True)
    assert resumed.returncode == 0, resumed.output[-3000:]
    said = (f"the dataset differs from the one checkpoint step00000004 trained on: 2 of its 4 items are gone from "
            f"{dataset}. The run goes on with the items there now (2 steps an epoch, 6 steps in all instead of 8)")
    (warning,) = [e for e in resumed.events("warning") if "dataset_changes" in e]
    assert warning["message"].startswith(said) and warning["step"] == 4
    assert said in resumed.output                              # the log
    assert resumed.status()["warnings"]["dataset"] == warning["message"]
    assert [e["step"] for e in resumed.events("step")][-2:] == [5, 6]


class _Output:
    """A launched run's output, read as it comes (a full pipe would block the ranks)."""
    def __init__(self, proc):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self.thread.start()

    def text(self) -> str:
        return "".join(self.lines)


def _rank_pid(config, local_rank: int) -> int:
    (pid,) = [p for p in _rank_pids(config)
              if f"--local_rank={local_rank}".encode() in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
    return pid


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _steps(run_dir: Path) -> int:
    return _status(run_dir).get("step") or 0


@pytest.mark.alone
@pytest.mark.slow
def test_a_frozen_rank_is_named_within_seconds_and_once_thawed_the_run_ends_as_an_uninterrupted_one(
        micro_flux_files, make_run, monkeypatch):
    """SIGSTOP on rank 1 mid-training: rank 0 names it (log, warning event, status) within a few seconds of the
    silence set, not after the process group's timeout; SIGCONT: it says the rank answers again and clears the
    status. Then the same with rank 0 (which hosts the store): rank 1 names it in the log. The run then ends with
    the LoRAs of an uninterrupted run."""
    setup = {**SETUP, "epochs": 3}
    # the uninterrupted run trains beside the frozen one (this test's wall time; the other core is mostly idle while a
    # rank is stopped): the silence is named within seconds of the silence set all the same
    reference_run = train_on_a_thread(make_run(micro_flux_files, images=4, name="reference", **setup), 2)
    config = make_run(micro_flux_files, images=4, name="frozen", run_name="frozen", **setup)
    run_dir = config.parent / "output" / "frozen"
    monkeypatch.setenv(SILENCE_ENV, "3")
    proc = launch(config, 2)
    output = _Output(proc)
    try:
        _wait_for(lambda: _steps(run_dir) >= 1)
        rank1 = _rank_pid(config, 1)
        os.kill(rank1, signal.SIGSTOP)
        frozen = time.monotonic()
        _wait_for(lambda: "rank-1" in _status(run_dir).get("warnings", {}), timeout=60)
        assert time.monotonic() - frozen < 20
        step = _steps(run_dir)
        time.sleep(3)
        assert _steps(run_dir) == step                        # rank 0 waits for it
        os.kill(rank1, signal.SIGCONT)
        _wait_for(lambda: "rank-1" not in _status(run_dir).get("warnings", {}), timeout=60)
        _wait_for(lambda: _steps(run_dir) > step, timeout=60)

        rank0 = _rank_pid(config, 0)
        os.kill(rank0, signal.SIGSTOP)
        _wait_for(lambda: "rank 1: rank 0 has not answered for" in output.text(), timeout=60)
        os.kill(rank0, signal.SIGCONT)
        proc.wait(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        output.thread.join(10)
    reference = reference_run.result()
    assert reference.returncode == 0, reference.output[-3000:]
    text = output.text()
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"rank 1 has not answered for \d+ s: its process may be stopped", text)
    # (that rank 0 answers again is logged only if rank 1's watch looks before the thawed run ends: not asserted)
    assert "rank 1 answers again after" in text
    run = reference.__class__(proc.returncode, text, config.parent / "output")
    warnings = [e for e in run.events("warning") if e.get("rank") == 1]   # named again as the silence doubles
    assert all(e["message"].startswith("rank 1 has not answered for") for e in warnings)
    silences = [e["silent_s"] for e in warnings]
    assert silences[0] >= 3 and all(b >= 2 * a - 1 for a, b in zip(silences, silences[1:])), silences
    (answer,) = run.events("peer")
    assert answer["rank"] == 1 and answer["time"] > warnings[-1]["time"]   # not named when rank 0 itself was stopped
    assert run.status()["state"] == "finished" and run.status()["warnings"] == {}
    for got, want in zip(run.loras(), reference.loras(), strict=True):
        a, b = load_file(str(got)), load_file(str(want))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


# The second schedule's kills, with ema: each resume is killed at the next one
SECOND_KILLS = [
    ("", "cache-written:text:1"),           # caching the captions: one text entry written, the rest not
    ("resume", "lora-written:2"),           # epoch 1's EMA LoRA as a .tmp beside its plain LoRA, no checkpoint
    ("resume", "write:pipetrain.json:1"),   # epoch 1's checkpoint: its completion mark being written
]


@pytest.mark.slow
def test_second_kill_schedule_text_caching_ema_lora_and_checkpoint_mark(micro_flux_files, make_run):
    setup = {**SETUP, "ema": True}
    reference = train_warm(make_run(micro_flux_files, images=4, name="reference", **setup), ranks=2)
    assert reference.returncode == 0, reference.output[-3000:]
    config = make_run(micro_flux_files, images=4, name="killed", run_name="chain", **setup)
    run_dir = config.parent / "output" / "chain"
    for n, (resume, kill_at) in enumerate(SECOND_KILLS):
        killed = _run(config, kill_at, resume=bool(resume), launched=n == 0)
        assert killed.returncode != 0, f"{kill_at} was never reached:\n{killed.output[-3000:]}"
    resumed = _run(config, resume=True)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.status()["state"] == "finished"
    leftovers = [p.name for p in run_dir.rglob(".*") if p.name != ".lock"]
    assert leftovers == [], leftovers
    want = {Path(e["path"]).name: e["path"] for e in reference.events() if e["type"] in ("lora_saved", "ema_saved")}
    got = sorted(p.name for p in (run_dir / "loras").glob("*.safetensors"))
    assert got == ["chain-epoch0001-ema.safetensors", "chain-epoch0001.safetensors", "chain-epoch0002-ema.safetensors",
                   "chain-epoch0002.safetensors"]
    for name in got:
        a, b = load_file(str(run_dir / "loras" / name)), load_file(want[name.replace("chain", reference.run_dir.name)])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), name
