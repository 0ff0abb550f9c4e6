"""The typed run configuration, loaded from and saved to TOML with diffusion-pipe's key names.

``RunConfig`` is the tree of each component's own small config (one module per part: ``dataset``, ``model``,
``sections``, ``run``; ``files`` reads and writes them; ``patch`` is how the nodes set run keys). Loading
rejects unknown keys, wrong types and out-of-range values before anything starts, naming the file and the
key. What a model type accepts is the architecture's own check, run by ``backend/preflight.py``.
"""
from .common import MAX_RESOLUTION, check_caption_extension, replace
from .dataset import BucketOptions, CaptionOptions, DatasetConfig, DirectoryConfig
from .files import load_dataset_config, load_run_config, save_toml, without_secrets
from .model import AdapterConfig, Dtype, ModelConfig, TextEncoderConfig, WeightDtype
from .run import RunConfig
from .sections import ClusterConfig, EvalDatasetConfig, MonitoringConfig, OptimizerConfig, SamplesConfig

__all__ = ["MAX_RESOLUTION", "AdapterConfig", "BucketOptions", "CaptionOptions", "ClusterConfig", "DatasetConfig",
           "DirectoryConfig", "Dtype", "EvalDatasetConfig", "ModelConfig", "MonitoringConfig", "OptimizerConfig",
           "RunConfig", "SamplesConfig", "TextEncoderConfig", "WeightDtype", "check_caption_extension",
           "load_dataset_config", "load_run_config", "replace", "save_toml", "without_secrets"]
