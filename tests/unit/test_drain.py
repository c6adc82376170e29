"""The trainer's side of a suspend (worker/trainer/drain.py): it stops after exactly the step
its agent wrote, read once the file is there; a file caught mid-write never stops it."""

from __future__ import annotations

from worker.trainer.drain import Drain


def test_stops_at_the_written_step_only(tmp_path):
    f = tmp_path / "drain"
    d = Drain(str(f))
    assert not d.due(3)  # no file yet: keep training
    f.write_text("")  # a partial write (the agent renames a whole one into place)
    assert not d.due(4)
    f.write_text("7")
    assert [d.due(s) for s in (5, 6, 7, 8)] == [False, False, True, False]


def test_without_a_drain_file_never_stops():
    assert not Drain(None).due(1)
