# SPDX-License-Identifier: GPL-3.0-or-later
"""The example workflows as a user first sees them: no node over another (title bars included), each node in one
group with a short title, groups apart, a thumbnail for ComfyUI's template browser. Sizes come from the files;
``test_user_path.py`` checks the same on the sizes the frontend gives the nodes once loaded."""
from __future__ import annotations

import pytest
from PIL import Image
from server_fixtures import REPO, load_example, node_box, overlapping

TEMPLATES = sorted(p.stem for p in (REPO / "example_workflows").glob("*.json"))
MAX_GROUP_TITLE = 16


def group_box(group) -> tuple:
    x, y, w, h = group["bounding"]
    return x, y, x + w, y + h


def inside(box, outer) -> bool:
    return outer[0] <= box[0] and outer[1] <= box[1] and box[2] <= outer[2] and box[3] <= outer[3]


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_nodes_do_not_overlap(name):
    nodes = load_example(name)["nodes"]
    boxes = {f"{n['id']} {n.get('title') or n['type']}": node_box(n["pos"], n["size"]) for n in nodes}
    assert not overlapping(boxes), overlapping(boxes)


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_groups_hold_every_node_and_have_short_titles(name):
    workflow = load_example(name)
    groups = workflow["groups"]
    assert groups, f"{name}: no groups"
    assert all(0 < len(g["title"]) <= MAX_GROUP_TITLE for g in groups), [g["title"] for g in groups]
    assert not overlapping({g["title"]: group_box(g) for g in groups})
    for n in workflow["nodes"]:
        holders = [g["title"] for g in groups if inside(node_box(n["pos"], n["size"]), group_box(g))]
        assert len(holders) == 1, f"{name}: node {n['id']} ({n['type']}) is in groups {holders}"


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_has_a_thumbnail(name):
    # ComfyUI's frontend (1.32) shows a custom node's template with /api/workflow_templates/<folder>/<name>.jpg
    with Image.open(REPO / "example_workflows" / f"{name}.jpg") as image:
        assert image.format == "JPEG" and image.width >= 200 and image.height >= 120, image


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_says_what_to_do_in_a_note(name):
    """ComfyUI's template browser shows a custom node's template by file name only: a note on the canvas says what
    to pick and what happens when queued."""
    notes = [n for n in load_example(name)["nodes"] if n["type"] == "MarkdownNote"]
    assert len(notes) == 1, name
    text = notes[0]["widgets_values"][0]
    must = {"train_a_lora": ["**Dataset**", "**Model**", "Queue", "models/loras/pipetrain/", "test_an_epoch_lora"],
            "test_an_epoch_lora": ["**Load Epoch LoRA**", "newest", "strength"]}[name]
    assert all(word in text for word in must), text
