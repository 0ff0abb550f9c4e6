"""The run folder as one contract (``backend/run/folder.py``): the run-id rules both processes apply, the format
version each run folder records, and no other module spelling the folder's file names."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from pipetrain.backend.run import folder as rundir
from pipetrain.backend.config import RunConfig
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.run.folder import (FORMAT, RUN_ID, RunDir, RunFormatError, RunsRoot, check_run_id,
    choose_run_dir, new_run_id)
from pipetrain.backend.config.schema import from_dict

REPO = Path(__file__).resolve().parents[2]
# names that belong to the run folder alone: only run/folder.py may spell them
CONTRACT = {"status.json", "events.jsonl", "stop", "launcher.json", "format.json", ".lock"}
OTHER_FOLDERS = {REPO / "backend" / "run" / "folder.py",
                 REPO / "bench" / "diffusion_pipe.py"}   # diffusion-pipe's own run folder, not a PipeTrain one
NOT_FILE_NAMES = {("backend/train/patches_deepspeed.py", "stop")}     # a parameter name in DeepSpeed's signature guard


def _cfg(tmp_path: Path, **run) -> RunConfig:
    return from_dict(RunConfig, {"output_dir": str(tmp_path / "out"), "dataset": "d.toml",
                                 "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}, **run})


def test_only_the_rundir_module_spells_the_run_folder_file_names():
    spelled = []
    for folder in ("backend", "launcher", "nodes", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            if path in OTHER_FOLDERS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Constant) and node.value in CONTRACT
                        and (str(path.relative_to(REPO)), node.value) not in NOT_FILE_NAMES):
                    spelled.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not spelled, spelled


def test_one_run_id_scheme_for_the_launcher_and_the_backend(tmp_path):
    run_id = new_run_id("my lora/../v2")
    assert check_run_id(run_id) == run_id and run_id.startswith("my-lora-v2-")
    assert RUN_ID.fullmatch(new_run_id()) and new_run_id() != new_run_id()
    # a run the CLI starts without a run_name gets an id the launcher's panel accepts
    run = choose_run_dir(_cfg(tmp_path), None)
    assert run.path.parent == tmp_path / "out" and check_run_id(run.name) == run.name
    assert RunsRoot(tmp_path / "out").path(run.name) == run.path


@pytest.mark.parametrize("name", ["../escape", "a/b", "cache", "with space"])
def test_a_run_name_outside_the_id_rules_is_refused_naming_the_key(tmp_path, name):
    with pytest.raises(ConfigError, match="run_name.*invalid run id"):
        choose_run_dir(_cfg(tmp_path, run_name=name), None)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_new_run_folder_records_the_format_and_a_resume_checks_it(tmp_path, monkeypatch):
    run = choose_run_dir(_cfg(tmp_path, run_name="r1"), None)
    assert json.loads(run.format_file.read_text()) == {"format": FORMAT}
    assert choose_run_dir(_cfg(tmp_path), "r1") == run                          # same format: resumes
    run.format_file.write_text(json.dumps({"format": FORMAT + 1}))
    with pytest.raises(RunFormatError, match=rf"r1 has format {FORMAT + 1}, newer than this PipeTrain reads "
                                             rf"\(format {FORMAT}\): update PipeTrain"):
        choose_run_dir(_cfg(tmp_path), "r1")
    run.format_file.write_text(json.dumps({"format": FORMAT}))
    monkeypatch.setattr(rundir, "FORMAT", FORMAT + 1)                         # a later PipeTrain meets this run
    with pytest.raises(RunFormatError, match=rf"format {FORMAT}, older than this PipeTrain reads.*start a new run"):
        choose_run_dir(_cfg(tmp_path), "r1")
    monkeypatch.undo()
    run.format_file.write_text('{"format": "$(rm -rf ~)"}')
    with pytest.raises(RunFormatError, match="unreadable") as e:
        run.check_format()
    assert "rm -rf" not in str(e.value)                                       # never quotes the file


def test_a_folder_from_before_format_versions_counts_as_the_first_format(tmp_path):
    run = RunDir(tmp_path / "old")
    run.path.mkdir()
    run.run_toml.write_text("")
    assert run.format() == 1
    run.claim_format()
    assert json.loads(run.format_file.read_text())["format"] == FORMAT


def test_the_launcher_refuses_to_resume_a_newer_format(tmp_path):
    from pipetrain.launcher.core import Launcher

    la = Launcher(tmp_path / "runs")
    run = la.dirs.run("newer")
    run.path.mkdir(parents=True)
    run.run_toml.write_text("")
    run.format_file.write_text(json.dumps({"format": FORMAT + 1}))
    with pytest.raises(RunFormatError, match="newer than this PipeTrain reads"):
        la.resume("newer")
    assert not run.launcher_file.exists()                                      # nothing was started


def test_stop_requests_and_the_runs_root_listing(tmp_path):
    root = RunsRoot(tmp_path)
    older, newer = root.run("a-older"), root.run("b-newer")
    for run, created in ((older, 100.0), (newer, 200.0)):
        run.path.mkdir()
        run.write_launcher({"created": created})
    (tmp_path / "not-a-run").mkdir()
    root.cache.path.mkdir()
    root.cache.status_file.write_text("{}")                                   # the cache folder is never a run
    assert root.ids() == ["b-newer", "a-older"]
    assert not older.stop_requested()
    older.request_stop()
    assert older.stop_requested() and older.stop_file.parent == older.path
    older.clear_stop()
    older.clear_stop()                                                          # twice: no error
    assert not older.stop_requested()
    assert RunDir(older) == older and Path(older) == older.path                # a RunDir passes where a path does
    assert older.started() == 100.0


def test_a_finished_run_is_not_resumed_and_the_newest_unfinished_one_is(tmp_path):
    """The CLI's --resume follows the route's rule (409 for a finished run): a finished run is refused by name,
    and a bare --resume takes the newest run that still has training left."""
    import os

    def run_with_checkpoint(name, state, mtime):
        run = choose_run_dir(_cfg(tmp_path, run_name=name), None)
        (run.path / "checkpoints" / "step5").mkdir(parents=True)
        (run.path / "checkpoints" / "step5" / "pipetrain.json").write_text("{}")
        (run.path / "checkpoints" / "latest").write_text("step5")
        run.status_file.write_text(json.dumps({"state": state}))
        os.utime(run.path, (mtime, mtime))
        return run

    stopped = run_with_checkpoint("older", "stopped", 1_000)
    finished = run_with_checkpoint("newer", "finished", 2_000)
    finished.status_file.write_text(json.dumps({"state": "finished", "epoch": 10, "epochs": 10, "total_steps": 40}))
    with pytest.raises(ConfigError, match="--resume newer: that run has finished and this config trains no further"):
        choose_run_dir(_cfg(tmp_path), "newer")
    assert choose_run_dir(_cfg(tmp_path), "") == stopped
    # more epochs than it finished with: it trains on (diffusion-pipe's way of extending a run)
    assert choose_run_dir(_cfg(tmp_path, epochs=12), "newer") == finished
    assert choose_run_dir(_cfg(tmp_path, epochs=12), "") == finished
    # stopped by max_steps in epoch 4 of 10: without the cap it trains on
    finished.status_file.write_text(json.dumps({"state": "finished", "epoch": 4, "epochs": 10, "total_steps": 16}))
    assert choose_run_dir(_cfg(tmp_path), "newer") == finished


def test_a_new_run_with_a_taken_run_name_is_refused_naming_resume(tmp_path):
    from pipetrain.backend.run.folder import check_unused

    cfg = _cfg(tmp_path, run_name="chain")
    prepared = choose_run_dir(cfg, None)
    prepared.run_toml.write_text("")            # what the launcher writes before the run reports: still unused
    check_unused(prepared, cfg)
    prepared.events_file.write_text('{"type": "start"}\n')
    before = sorted((p.name, p.read_bytes()) for p in prepared.path.iterdir() if p.is_file())
    again = choose_run_dir(cfg, None)
    with pytest.raises(ConfigError, match=rf"key 'run_name': {again.path} already holds a run: continue it with "
                                          r"--resume chain, or give this run another run_name"):
        check_unused(again, cfg)
    assert sorted((p.name, p.read_bytes()) for p in prepared.path.iterdir() if p.is_file()) == before


def test_a_resume_names_a_run_folder_of_the_output_folder_only(tmp_path):
    """``--resume`` runs what its folder holds (config, checkpoints): a folder elsewhere, by path, by ``..`` or
    through a link in the output folder, is refused naming the output folder; nothing is written there."""
    import os

    def with_checkpoint(run: RunDir) -> RunDir:
        (run.path / "checkpoints" / "step5").mkdir(parents=True)
        (run.path / "checkpoints" / "step5" / "pipetrain.json").write_text("{}")
        (run.path / "checkpoints" / "latest").write_text("step5")
        run.status_file.write_text(json.dumps({"state": "stopped"}))
        return run

    own = with_checkpoint(choose_run_dir(_cfg(tmp_path, run_name="own"), None))
    elsewhere = with_checkpoint(RunDir(tmp_path / "elsewhere" / "sent"))
    os.utime(elsewhere.path, (4_000_000_000, 4_000_000_000))      # newer than every run in the output folder
    (tmp_path / "out" / "linked").symlink_to(elsewhere.path, target_is_directory=True)
    out = tmp_path / "out"
    for resume in (str(elsewhere.path), "../elsewhere/sent", "linked", str(out / "linked"), str(tmp_path / "out")):
        with pytest.raises(ConfigError, match=rf"--resume {resume}: not a run folder of the output folder {out} "
                                              r"\(output_dir\).*copy the run folder into"):
            choose_run_dir(_cfg(tmp_path), resume)
    with pytest.raises(ConfigError, match=r"--resume linked: not a run folder of the output folder"):
        choose_run_dir(_cfg(tmp_path, run_name="linked"), "")        # a run_name that is a link out
    assert sorted(p.name for p in elsewhere.path.iterdir()) == ["checkpoints", "status.json"]   # nothing written
    assert choose_run_dir(_cfg(tmp_path), "") == own                 # a bare --resume passes the link over
    assert choose_run_dir(_cfg(tmp_path), "own") == own
    assert choose_run_dir(_cfg(tmp_path), str(own.path)) == own      # its own path is fine


def test_the_launcher_resumes_only_a_config_of_its_own_runs_folder(tmp_path):
    """The panel's Resume runs ``train <run>/run.toml --resume <id>``: a run.toml whose output_dir is another folder
    would resume (and run the checkpoint of) a run there; one that is a link, or a checkpoints link, leads out of
    the run folder. Each is refused naming the run and nothing starts."""
    from pipetrain.backend.config import save_toml
    from pipetrain.launcher.core import Launcher, LauncherError, check_own_config

    la = Launcher(tmp_path / "runs")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "planted" / "checkpoints" / "step5").mkdir(parents=True)

    def run_folder(name: str, output_dir: Path) -> RunDir:
        run = la.dirs.run(name)
        (run.checkpoints / "step5").mkdir(parents=True)
        (run.checkpoints / "step5" / "pipetrain.json").write_text("{}")
        (run.checkpoints / "latest").write_text("step5")
        save_toml(_cfg(tmp_path, output_dir=str(output_dir), run_name="planted"), run.run_toml)
        run.status_file.write_text(json.dumps({"state": "stopped"}))
        return run

    planted = run_folder("planted", elsewhere)
    with pytest.raises(LauncherError, match=rf"run planted: its run.toml's output_dir is not {la.dirs.root}"):
        la.resume("planted")
    linked = run_folder("linked", la.dirs.root)
    linked.run_toml.rename(tmp_path / "outside.toml")
    linked.run_toml.symlink_to(tmp_path / "outside.toml")
    with pytest.raises(RunFormatError, match=f"run folder {linked.path}: run.toml is a link"):
        la.resume("linked")
    ckpt = run_folder("ckpt-link", la.dirs.root)
    import shutil
    shutil.move(ckpt.checkpoints, elsewhere / "ckpts")
    ckpt.checkpoints.symlink_to(elsewhere / "ckpts", target_is_directory=True)
    with pytest.raises(RunFormatError, match=f"run folder {ckpt.path}: checkpoints is a link"):
        la.resume("ckpt-link")
    for run in (planted, linked, ckpt):
        assert not run.launcher_file.exists()                                  # nothing was started
    check_own_config(run_folder("own", la.dirs.root), la.dirs.root)          # what the launcher writes passes


def test_a_resume_refuses_a_run_folder_holding_a_link(tmp_path):
    """A run folder someone sent (a tarball keeps links): a resume appends to its log and events and rewrites its
    lock file, so ``.lock`` linked to a file of the user's would have it truncated. Refused naming the link, by the
    CLI's --resume and the panel's Resume alike; the linked file is untouched."""
    from pipetrain.backend.config import save_toml
    from pipetrain.launcher.core import Launcher

    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    run = choose_run_dir(_cfg(tmp_path, run_name="sent"), None)
    (run.checkpoints / "step5").mkdir(parents=True)
    (run.checkpoints / "step5" / "pipetrain.json").write_text("{}")
    (run.checkpoints / "latest").write_text("step5")
    run.status_file.write_text(json.dumps({"state": "stopped"}))
    save_toml(_cfg(tmp_path), run.run_toml)
    for link in (run.lock_file, run.events_file, run.checkpoints / "step5" / "rng_rank00000.safetensors"):
        link.symlink_to(victim)
        name = link.relative_to(run.path)
        for resume in ("sent", ""):
            with pytest.raises(RunFormatError, match=f"run folder {run.path}: {name} is a link"):
                choose_run_dir(_cfg(tmp_path), resume)
        with pytest.raises(RunFormatError, match=f"{name} is a link"):
            Launcher(tmp_path / "out").resume("sent")
        link.unlink()
    assert victim.read_text() == "keep me" and not run.launcher_file.exists()
    assert choose_run_dir(_cfg(tmp_path), "sent") == run                      # without the links: resumed
