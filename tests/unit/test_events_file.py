# SPDX-License-Identifier: GPL-3.0-or-later
"""events.jsonl after a kill: a line cut short by the kill is skipped on read and never joins the next run's
first event (a resume's ``start``)."""
from pipetrain.backend.rundir import RunDir, read_events
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
