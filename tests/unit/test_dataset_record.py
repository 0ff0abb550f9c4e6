# SPDX-License-Identifier: GPL-3.0-or-later
"""What a checkpoint keeps of the dataset, and what a resume says when it changed (issue #40 item 9b)."""
from types import SimpleNamespace

from pipetrain.backend.train.dataset_record import changes, record


def _entries(*paths):
    return [SimpleNamespace(path=p) for p in paths]


def test_items_gone_new_or_swapped_are_counted_per_folder():
    saved = record(_entries("/a/1.png", "/a/1.png", "/a/2.png", "/a/3.png", "/b/1.png"))   # 1.png at two sizes
    assert saved["/a"][0] == 3 and saved["/b"][0] == 1
    assert changes(saved, record(_entries("/a/1.png", "/a/2.png", "/a/3.png", "/b/1.png"))) == []
    assert changes(saved, record(_entries("/a/1.png", "/b/1.png"))) == ["2 of its 3 items are gone from /a"]
    assert changes(saved, record(_entries("/a/1.png", "/a/2.png", "/a/4.png", "/b/1.png"))) == [
        "items in /a were replaced by others (still 3)"]
    assert changes(saved, record(_entries("/a/1.png", "/a/2.png", "/a/3.png", "/c/1.png"))) == [
        "1 of its 1 items are gone from /b", "1 items are new in /c"]


def test_a_checkpoint_without_a_record_or_with_a_foreign_one_says_nothing():
    now = record(_entries("/a/1.png"))
    assert changes(None, now) == [] and changes("x", now) == []
    assert changes({"/a": "not ours"}, now) == []
