# SPDX-License-Identifier: GPL-3.0-or-later
"""The custom socket types that carry PipeTrain specs between nodes."""
from comfy_api.latest import io

Dataset = io.Custom("PIPETRAIN_DATASET")
Model = io.Custom("PIPETRAIN_MODEL")
Adapter = io.Custom("PIPETRAIN_ADAPTER")
Optimizer = io.Custom("PIPETRAIN_OPTIMIZER")
Schedule = io.Custom("PIPETRAIN_SCHEDULE")
Parallelism = io.Custom("PIPETRAIN_PARALLELISM")
Memory = io.Custom("PIPETRAIN_MEMORY")
Run = io.Custom("PIPETRAIN_RUN")
Samples = io.Custom("PIPETRAIN_SAMPLES")

CATEGORY = "PipeTrain"
