# SPDX-License-Identifier: GPL-3.0-or-later
"""A dataset written from graph images (the Images To Dataset node's writer) trains like any folder."""
import numpy as np
import pytest

from pipetrain.backend.data.graph_dataset import write_dataset
from tests.conftest import train

pytestmark = pytest.mark.slow


def test_a_graph_built_dataset_trains_and_caches_each_image_with_its_caption(micro_flux_files, make_run, tmp_path):
    import tomli_w
    import tomllib

    rng = np.random.default_rng(3)
    folder = write_dataset(rng.integers(0, 256, (3, 64, 80, 3), dtype=np.uint8),
                           ["sks a cat", "sks a dog", "sks a bird"], tmp_path / "datasets", "pets")
    config = make_run(micro_flux_files, images=1, epochs=1)
    dataset = config.parent / "dataset.toml"
    data = tomllib.loads(dataset.read_text())
    data["directory"] = [{"path": str(folder), "num_repeats": 1}]
    dataset.write_text(tomli_w.dumps(data))
    run = train(config, 2)
    assert run.returncode == 0, run.output[-3000:]
    steps = run.events("step")
    assert len(steps) == 3 and run.losses() and len(run.loras()) == 1
    [cached] = run.events("cached")
    assert cached["entries"] == 3 and cached["texts_encoded"] == 3, cached
