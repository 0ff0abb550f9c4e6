# SPDX-License-Identifier: GPL-3.0-or-later
"""events.jsonl after a kill: a line cut short by the kill is skipped on read and never joins the next run's
first event (a resume's ``start``)."""
import pytest

from pipetrain.backend.run.folder import RunDir, read_events
from pipetrain.backend.train.events import RunReporter


def test_a_cut_line_does_not_swallow_the_next_event(tmp_path):
    run = RunDir(tmp_path)
    run.events_file.write_text('{"type": "step", "step": 1}\n{"type": "step", "st')   # killed mid-write
    reporter = RunReporter(run, enabled=True)
    reporter.event("start", resumed=True)
    reporter.event("step", step=2)
    events, _ = read_events(run.events_file)
    assert [(e["type"], e.get("step")) for e in events] == [("step", 1), ("start", None), ("step", 2)]
    assert run.events_file.read_text().count("\n") == 4          # the cut line stays a line of its own


def test_a_binary_line_is_skipped_and_later_events_kept(tmp_path):
    run = RunDir(tmp_path)
    run.events_file.write_bytes(b'{"type": "step", "step": 1}\n\xff\xfe\x00garbage\x80\n{"type": "step", "step": 2}\n'
                                b'\x00\x01')
    reporter = RunReporter(run, enabled=True)
    reporter.event("start", resumed=True)
    events, _ = read_events(run.events_file)
    assert [(e["type"], e.get("step")) for e in events] == [("step", 1), ("step", 2), ("start", None)]


def _saved_run(tmp_path) -> RunDir:
    run = RunDir(tmp_path)
    first = RunReporter(run, enabled=True)
    for epoch in (1, 2):
        path = str(tmp_path / f"run-epoch{epoch:04d}.safetensors")
        first.update(loras=first.status.get("loras", []) + [{"epoch": epoch, "step": 4 * epoch, "path": path}])
        first.event("lora_saved", epoch=epoch, step=4 * epoch, path=path)
    return run


@pytest.mark.parametrize("damage", ["cut", "binary", "list"])
def test_a_damaged_status_is_written_anew_keeping_the_saved_loras(tmp_path, damage):
    """A resume whose status.json was cut (a full disk's last rewrite in place, a copy), holds bytes that are no
    text, or holds JSON that is no object: the run starts (no UnicodeDecodeError or TypeError), says so naming the
    file, and its status lists the LoRAs saved before, from the events."""
    run = _saved_run(tmp_path)
    want = RunReporter(run, enabled=True).status["loras"]
    data = run.status_file.read_bytes()
    run.status_file.write_bytes({"cut": data[:len(data) // 2], "binary": b"\x89PNG\xff\x00" + data,
                                 "list": b"[1, 2]"}[damage])
    resumed = RunReporter(run, enabled=True)
    assert resumed.status["loras"] == want and len(want) == 2
    resumed.update(state="training")
    assert run.read_status()["loras"] == want
    (warning,) = [e for e in read_events(run.events_file)[0] if e["type"] == "warning"]
    assert warning["message"].startswith(f"{run.status_file} could not be read (cut or damaged)")
