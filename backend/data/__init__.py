"""Reading the dataset: images and captions, aspect-ratio buckets, repeats and per-rank batches."""
from .buckets import assign_bucket, build_examples, make_buckets
from .captions import caption_variants, drops_caption, expand_captions
from .epoch_plan import EpochPlan
from .items import MediaItem, Example
from .pixels import PREPROCESS_VERSION, load_pixels
from .scan import ScanResult, check_control_paths, scan_dataset

__all__ = [
    "PREPROCESS_VERSION", "EpochPlan", "MediaItem", "Example", "ScanResult", "assign_bucket",
    "build_examples", "caption_variants", "check_control_paths", "drops_caption", "expand_captions", "load_pixels",
    "make_buckets",
    "scan_dataset",
]
