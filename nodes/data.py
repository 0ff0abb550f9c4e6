# SPDX-License-Identifier: GPL-3.0-or-later
"""Dataset and Model: where the images are and which model files to train on."""
from __future__ import annotations

from pathlib import Path

from comfy_api.latest import io, ui

from ..backend.config.patch import RunPatch
from ..backend.errors import PipeTrainError
from ..backend.config import check_caption_extension
from ..launcher.build import QUEUE_TIME_ENTRIES, check_dataset_folder
from ..launcher.specs import DatasetSpec
from . import types as t
from .declared import CheckedNode
from .widgets import DATASET, DIRECTORY, choices, start, words

WEIGHT_DTYPES = ["default", "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]
COMPUTE_DTYPES = choices("model.dtype")
CKPT_PREFIX = "checkpoints/"
NONE = "none"
# vae / text_encoder_1: the part comes from the diffusion_model file, an all-in-one checkpoint (models/checkpoints)
FROM_CHECKPOINT = "(from the checkpoint)"


def dataset_folder(folder: str) -> Path:
    import folder_paths
    p = Path(folder.strip()).expanduser()
    return (p if p.is_absolute() else Path(folder_paths.get_input_directory()) / p).resolve()


def parse_frame_buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in words(text))
    except ValueError:
        raise ValueError(f"frame_buckets {text!r}: write whole numbers separated by commas, e.g. 1, 33") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"frame_buckets {text!r}: each must be 1 or more")
    return values


def parse_resolutions(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in words(text))
    except ValueError:
        raise ValueError(f"resolutions {text!r}: write whole numbers separated by commas, e.g. 512, 768") from None
    if not values or any(v < 64 or v % 16 or v > 8192 for v in values):
        raise ValueError(f"resolutions {text!r}: each must be a multiple of 16 from 64 to 8192")
    return values


def parse_ar_buckets(text: str) -> tuple[float, ...] | None:
    """"0.75, 1.0, 1216x832" -> ratios (a WxH entry is W / H); empty: None (min_ar..max_ar instead)."""
    out = []
    for part in words(text):
        try:
            w, _, h = part.lower().partition("x")
            out.append(int(w) / int(h) if h else float(part))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"ar_buckets {text!r}: write ratios or WxH sizes separated by commas, e.g. "
                             "0.75, 1.0, 1216x832") from None
    return tuple(out) or None


def parse_size_buckets(text: str) -> tuple[tuple[int, ...], ...] | None:
    """"832x480, 832x480x33" -> [width, height(, frames)] entries; empty: None."""
    out = []
    for part in words(text):
        try:
            values = tuple(int(v) for v in part.lower().split("x"))
        except ValueError:
            values = ()
        if len(values) not in (2, 3):
            raise ValueError(f"size_buckets {text!r}: write WxH or WxHxFRAMES entries separated by commas, e.g. "
                             "832x480, 832x480x33")
        out.append(values)
    return tuple(out) or None


def dataset_input_error(folder=None, resolutions=None, caption_extension=None, frame_buckets=None,
                        control_folder=None, look_at=None) -> str | None:
    """What is wrong with the Dataset node's inputs given (None: not checked), or None; ``look_at``: at most this
    many entries of the folder are looked at."""
    try:
        if caption_extension is not None:   # a file ending, never a path (the backend's rule)
            check_caption_extension(caption_extension, "the Dataset node", "caption_extension")
        if folder is not None:
            check_dataset_folder(dataset_folder(folder), caption_extension or ".txt", look_at)
        for control in words(control_folder):
            if not dataset_folder(control).is_dir():
                return (f"control_folder {control!r}: {dataset_folder(control)} is not a folder; pick the folder of "
                        "control images under ComfyUI's input directory or type an absolute path (several: "
                        "separated by commas)")
        if resolutions is not None:
            parse_resolutions(resolutions)
        if frame_buckets is not None:
            parse_frame_buckets(frame_buckets)
    except (PipeTrainError, ValueError) as e:
        return str(e)
    except OSError as e:     # a path the system refuses (too long, no permission)
        return f"folder: {e.strerror}"
    return None


class DatasetNode(CheckedNode):
    SHOWN = ("folder", "resolutions", "enable_ar_bucket", "num_repeats", "caption_extension", "frame_buckets",
             "control_folder")   # the rest folded as advanced

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainDataset", display_name="PipeTrain Dataset", category=t.CATEGORY,
            description="A folder of images with same-name caption files. Chain several into one dataset.",
            inputs=[
                io.String.Input("folder", default="", tooltip="Folder of images (+ captions): a path under ComfyUI's "
                                "input directory, or an absolute path"),
                io.String.Input("resolutions", default=", ".join(map(str, start("resolutions", DATASET))),
                                tooltip="Training side length(s) in pixels, comma "
                                "separated multiples of 16 (e.g. 512, 1024); each image trains at every resolution"),
                io.Boolean.Input("enable_ar_bucket", default=start("enable_ar_bucket", DATASET),
                                 tooltip="Group images by aspect ratio instead of "
                                 "cropping them square"),
                io.Float.Input("min_ar", default=start("min_ar", DATASET), min=0.1, max=1.0, step=0.05,
                               tooltip="Smallest aspect ratio "
                               "(width/height) of a bucket"),
                io.Float.Input("max_ar", default=start("max_ar", DATASET), min=1.0, max=10.0, step=0.05,
                               tooltip="Largest aspect ratio "
                               "(width/height) of a bucket"),
                io.Int.Input("num_ar_buckets", default=start("num_ar_buckets", DATASET), min=1, max=64,
                             tooltip="Number of aspect-ratio buckets"),
                io.Int.Input("num_repeats", default=start("num_repeats", DATASET), min=1, max=1000,
                             tooltip="How often each image of this folder "
                             "is seen per epoch"),
                io.String.Input("caption_extension", default=start("caption_extension", DATASET),
                                tooltip="Extension of the caption file beside "
                                "each image (a missing caption trains with an empty one)"),
                io.String.Input("caption_prefix", optional=True, default=start("caption_prefix", DATASET),
                                tooltip="Text put before every caption of this "
                                "folder, e.g. a trigger word 'sks, ' (outside any tag shuffling)"),
                io.Boolean.Input("shuffle_tags", optional=True, default=start("shuffle_tags", DATASET),
                                 tooltip="Train on a copy of each caption with its "
                                 "comma-separated tags shuffled (the same as 1 shuffled variant)"),
                io.Int.Input("cache_shuffle_num", optional=True, default=start("cache_shuffle_num", DATASET), min=0,
                             max=64, tooltip="Tag-shuffled variants of each "
                             "caption, each trained as its own example (0: the caption as written)"),
                io.String.Input("frame_buckets", optional=True,
                                default=", ".join(map(str, start("frame_buckets", DATASET))),
                                tooltip="Video models: clip lengths in frames, comma "
                                "separated (Wan: 4k+1, e.g. 1, 33, 65); each video trains as the longest it fills"),
                io.Float.Input("uncond_fraction", optional=True, default=start("uncond_fraction"), min=0.0, max=0.99,
                               step=0.01, tooltip="Caption "
                               "dropout: train this fraction of samples with the empty caption (the run uses the "
                               "training dataset's value; an eval dataset's is ignored)"),
                io.String.Input("control_folder", optional=True, default="", tooltip="Edit models (Flux Kontext, "
                                "Qwen-Image-Edit, Flux 2 edit): the folder of control images, each named like its "
                                "training image (a.png <-> a.jpg); under ComfyUI's input directory or an absolute "
                                "path. Several folders separated by commas give each image several references "
                                "(qwen_image_edit_plus: up to 3; flux2_edit), in that order. Leave empty for other "
                                "models"),
                t.Dataset.Input("previous", optional=True, tooltip="Another PipeTrain Dataset to add this folder to"),
                io.Boolean.Input("skip_empty_caption", optional=True, default=start("skip_empty_caption", DATASET),
                                 tooltip="Leave out images without a caption (else they train with an empty one)"),
                io.String.Input("cache_shuffle_delimiter", optional=True,
                                default=start("cache_shuffle_delimiter", DATASET), tooltip="What separates the tags "
                                "that shuffle_tags and cache_shuffle_num shuffle"),
                io.Combo.Input("on_unreadable", optional=True, options=choices("on_unreadable", DATASET),
                               default=start("on_unreadable", DATASET), tooltip="An image or video that cannot be "
                               "read: skip it (listed in the log) or stop with an error"),
                io.Int.Input("caching_batch_size", optional=True, default=start("caching_batch_size"), min=1, max=256,
                             tooltip="Images encoded at once when the latents are cached (the training dataset's "
                             "value counts)"),
                io.Boolean.Input("is_reg", optional=True, default=start("is_reg", DIRECTORY),
                                 tooltip="This folder holds regularisation (prior-preservation) images, e.g. generic "
                                 "images of the class captioned without the trigger word: drawn into each epoch at "
                                 "reg_ratio, their loss logged apart (train/loss_reg). Chain it with the folder of "
                                 "the images to learn"),
                io.Float.Input("reg_ratio", optional=True, default=start("reg_ratio", DATASET), min=0.01, max=0.99,
                               step=0.01, tooltip="With is_reg folders: the share of each epoch's samples drawn "
                               "from them (0.5: as many as the training samples). The dataset's value: the one on "
                               "the Dataset node wired to Cache or Train"),
                io.String.Input("mask_folder", optional=True, default="", tooltip="Masked training: a folder of "
                                "mask images named like the training images (a.png <-> a.png); each pixel's red "
                                "value is its loss weight (white trains, black does not, grey partly); under "
                                "ComfyUI's input directory or an absolute path. Empty: the whole image trains"),
                io.String.Input("default_mask_file", optional=True, default="", tooltip="Masked training: the mask "
                                "for images without one in mask_folder (empty: those train whole)"),
                io.String.Input("control_mask_folder", optional=True, default="", tooltip="Wan VACE: a folder of "
                                "control masks (videos or images) named like the training files; white marks the "
                                "region to generate (WanVaceToVideo's control_masks). Empty: no mask"),
                io.String.Input("reference", optional=True, default="", tooltip="Wan VACE: the reference image "
                                "(WanVaceToVideo's reference_image): a folder of images named like the training "
                                "files, or one image for every file of this folder. Empty: none"),
                io.String.Input("ar_buckets", optional=True, default="", tooltip="With enable_ar_bucket: exactly these "
                                "aspect ratios instead of min_ar..max_ar, comma separated ratios or WxH sizes (e.g. "
                                "0.75, 1.0, 1216x832); empty: num_ar_buckets spaced ones"),
                io.String.Input("size_buckets", optional=True, default="", tooltip="Exact training sizes instead of "
                                "resolutions and ratios: WxH for stills, WxHxFRAMES for clips (e.g. 832x480, "
                                "832x480x33); each image takes the nearest ratio. Empty: off"),
                io.Float.Input("subsample_ratio", optional=True, default=start("subsample_ratio", DATASET, off=1.0),
                               min=0.01, max=1.0, step=0.01, tooltip="The share of each epoch's batches to train "
                               "(diffusion-pipe's key; 1: all). The dataset's value: the one on the Dataset node "
                               "wired to Cache or Train"),
            ],
            outputs=[t.Dataset.Output(display_name="dataset")],
        )

    @classmethod
    def validate_inputs(cls, folder=None):
        # Only the folder at queue time: ComfyUI repeats a failed check's message once per input this method names
        # (a missing folder came 5 times). The rest is checked when the node runs, before the Cache and Train nodes
        # that take its output.
        # It runs on ComfyUI's event loop, which serves every request: a bounded look (QUEUE_TIME_ENTRIES)
        return dataset_input_error(folder=folder, look_at=QUEUE_TIME_ENTRIES) or True

    @classmethod
    def execute(cls, folder, resolutions, enable_ar_bucket, min_ar, max_ar, num_ar_buckets, num_repeats,
                caption_extension, frame_buckets=None, uncond_fraction=None, control_folder="", previous=None,
                on_unreadable=None, caching_batch_size=None, is_reg=False, reg_ratio=None, subsample_ratio=None,
                ar_buckets="", size_buckets="", mask_folder="", default_mask_file="", control_mask_folder="", reference="",
                **directory_keys) -> io.NodeOutput:
        frame_buckets = frame_buckets or ", ".join(map(str, start("frame_buckets", DATASET)))
        error = dataset_input_error(folder, resolutions, caption_extension, frame_buckets, control_folder)
        if error:
            raise ValueError(error)
        res = parse_resolutions(resolutions)
        ext = caption_extension if caption_extension.startswith(".") else "." + caption_extension
        controls = tuple(str(dataset_folder(c)) for c in words(control_folder))   # several: a list in the file
        control = None if not controls else controls[0] if len(controls) == 1 else controls
        # caption_prefix, shuffle_tags, cache_shuffle_num, skip_empty_caption, cache_shuffle_delimiter: as named
        directory = RunPatch.of({**directory_keys, "path": str(dataset_folder(folder)), "num_repeats": num_repeats,
                                 "resolutions": res, "caption_extension": ext,
                                 "frame_buckets": parse_frame_buckets(frame_buckets), "control_path": control,
                                 "is_reg": is_reg or None,   # off: the key left out
                                 "mask_path": str(dataset_folder(mask_folder)) if mask_folder.strip() else None,
                                 "default_mask_file": str(dataset_folder(default_mask_file))
                                 if default_mask_file.strip() else None,
                                 "control_mask_path": str(dataset_folder(control_mask_folder))
                                 if control_mask_folder.strip() else None,
                                 "reference_path": str(dataset_folder(reference)) if reference.strip() else None})
        shared = RunPatch.of(dict(resolutions=res, enable_ar_bucket=enable_ar_bucket, min_ar=min_ar, max_ar=max_ar,
                                  num_ar_buckets=num_ar_buckets, on_unreadable=on_unreadable, reg_ratio=reg_ratio,
                                  subsample_ratio=None if subsample_ratio is None or subsample_ratio >= 1
                                  else subsample_ratio,   # 1: every batch, the key left out
                                  ar_buckets=parse_ar_buckets(ar_buckets), size_buckets=parse_size_buckets(size_buckets)))
        run = RunPatch.of(dict(uncond_fraction=uncond_fraction, caching_batch_size=caching_batch_size))
        spec = DatasetSpec((directory,), shared, run)
        return io.NodeOutput(previous.plus(spec) if previous is not None else spec)


GRAPH_DATASETS = "pipetrain_datasets"   # under ComfyUI's input directory


class ImagesToDatasetNode(CheckedNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainImagesToDataset", display_name="PipeTrain Images To Dataset", category=t.CATEGORY,
            is_output_node=True,   # queued alone it writes the folder and shows its name
            description="Images from the graph (generated, edited, loaded) with their captions, written as a "
                        "dataset folder for a PipeTrain Dataset node's folder input.",
            inputs=[
                io.Image.Input("images", tooltip="The training images, a batch (join several with Batch Images)"),
                io.String.Input("captions", multiline=True, default="", tooltip="One caption per line, in the "
                                "batch's order, or a single line for every image (empty: no captions)"),
                io.String.Input("name", default="graph", tooltip="The start of the folder's name (letters, digits, "
                                "- and _); the rest is a digest of the images and captions, so the same ones "
                                "always give the same folder"),
            ],
            outputs=[io.String.Output(display_name="folder")],
        )

    @classmethod
    def execute(cls, images, captions, name) -> io.NodeOutput:
        import folder_paths
        import numpy as np

        from ..backend.data.graph_dataset import split_captions, write_dataset
        import torch
        pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        root = Path(folder_paths.get_input_directory()) / GRAPH_DATASETS
        folder = write_dataset(np.asarray(pixels), split_captions(captions), root, name.strip() or "graph")
        text = f"{GRAPH_DATASETS}/{folder.name}"
        return io.NodeOutput(text, ui=ui.PreviewText(f"{text} ({len(pixels)} images)"))


def diffusion_model_options() -> list[str]:
    import folder_paths
    return (folder_paths.get_filename_list("diffusion_models")
            + [CKPT_PREFIX + n for n in folder_paths.get_filename_list("checkpoints")])


def model_input_error(diffusion_model=None, model_type=None, min_t=0.0, max_t=1.0,
                      queue_time: bool = False) -> str | None:
    """What is wrong with the Model node's file, type and timestep range (None: not checked), or None;
    ``queue_time``: the check on ComfyUI's event loop, bounded (``header_is_quick``)."""
    from ..backend.errors import ModelError
    if min_t is not None and max_t is not None and min_t >= max_t:
        return f"min_t ({min_t}) must be below max_t ({max_t})"
    if diffusion_model is None:
        return None
    path = model_path(diffusion_model)
    if path is None:
        return f"model file {diffusion_model} not found in models/diffusion_models or models/checkpoints"
    if not Path(path).is_file():   # a FIFO or a device would block or never end: not opened
        return f"model file {diffusion_model}: not a regular file; pick a model file"
    if queue_time:
        return _queue_time_verdict(path)
    try:
        detect(path, model_type)     # None: the file's architecture alone (whatever model_type says)
    except (ModelError, ValueError) as e:
        return str(e)
    return None


_verdicts: dict[tuple, str | None] = {}   # (path, size, mtime) -> the queue-time check's answer


def _queue_time_verdict(path: str) -> str | None:
    """The file's architecture check on ComfyUI's event loop: once per version of the file (a prompt may name it
    in many Model nodes), and only where its header tells it quickly (``header_is_quick``); else None, the check
    being made when the node runs, on ComfyUI's worker thread."""
    from ..backend.errors import ModelError
    st = Path(path).stat()
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _verdicts:
        verdict = None
        if header_is_quick(path):
            try:
                detect(path, None)
            except (ModelError, ValueError) as e:
                verdict = str(e)
        if len(_verdicts) > 256:   # model files come and go: the memo stays small
            _verdicts.clear()
        _verdicts[key] = verdict
    return _verdicts[key]


# a safetensors header the queue-time check reads at most: a real diffusion model's lists a few thousand tensors
# in well under this; the check runs on ComfyUI's event loop, which serves every request meanwhile
QUEUE_TIME_HEADER = 2 << 20


def header_is_quick(path: str) -> bool:
    """Whether the file's architecture can be told on ComfyUI's event loop: a safetensors file whose header is at
    most QUEUE_TIME_HEADER bytes. Any other format (.ckpt, .pt, .bin) lists its tensors only once unpickled
    whole, seconds for a large file."""
    if Path(path).suffix.lower() not in (".safetensors", ".sft"):
        return False
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
    except OSError:
        return True    # unreadable: the check says so at once
    return size <= QUEUE_TIME_HEADER


def model_path(name: str) -> str | None:
    import folder_paths
    found = folder_paths.get_full_path("diffusion_models", name)
    if found is None and name.startswith(CKPT_PREFIX):
        found = folder_paths.get_full_path("checkpoints", name[len(CKPT_PREFIX):])
    return found


AUTO = "auto (detected)"


def detect(path: str, model_type: str = AUTO) -> str:
    """The model type of ``path``: detected, or ``model_type`` when the user picked one the file can be (types
    that detection cannot tell apart share ComfyUI's model class: Flux Kontext is a Flux file, ...)."""
    from ..backend.models.loading import SUPPORTED_ARCHS, detect_architecture
    from ..backend.models.registry import arch_spec
    arch = detect_architecture(path)
    if arch is None:
        raise ValueError(f"{Path(path).name}: not a diffusion model of an architecture PipeTrain trains "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)}); pick the diffusion model file, not a LoRA, "
                         "VAE or text encoder")
    if model_type in (AUTO, None, arch):
        return arch
    if set(arch_spec(model_type).comfy_configs) & set(arch_spec(arch).comfy_configs):
        return model_type
    raise ValueError(f"model_type {model_type!r} does not fit {Path(path).name}, which is a {arch} model; choose "
                     f"{AUTO!r} or a type of the same model family")


def model_types() -> list[str]:
    from ..backend.models.registry import ADAPTERS
    return sorted(ADAPTERS)


def clip_vision_options() -> list[str]:
    import folder_paths
    return folder_paths.get_filename_list("clip_vision")


def parity_text(model_type: str) -> str:
    """The parity verdict of ``model_type`` on this ComfyUI, as a run will find it (``backend/parity/check.py``;
    memoised, so the node pays for it once per ComfyUI)."""
    from ..backend.models.registry import ADAPTERS
    from ..backend.parity.check import check_model_type
    r = check_model_type(model_type)
    if r.ok or model_type not in ADAPTERS:
        return f"{model_type} on ComfyUI {r.comfyui_version}: {r.summary()}" if r.ok else r.message()
    # backend/parity/fallback.py: where only the API moved, the run trains on the pinned copy instead
    return (f"{r.message()} Before refusing, a run compares this ComfyUI's own forward with PipeTrain's pinned "
            f"ComfyUI's: where they compute the same, the run trains on the pinned copy and its status says so.")


class ModelNode(CheckedNode):
    SHOWN = ("diffusion_model", "model_type", "text_encoder_1", "text_encoder_2", "text_encoder_3", "vae",
             "weight_dtype", "compute_dtype")   # the rest folded as advanced

    @classmethod
    def define_schema(cls):
        import folder_paths
        tes = folder_paths.get_filename_list("text_encoders")
        return io.Schema(
            node_id="PipeTrainModel", display_name="PipeTrain Model", category=t.CATEGORY,
            description="The model to train; its architecture is detected from the file (model_type picks what "
                        "the weights cannot tell: an edit or image-to-video variant).",
            inputs=[
                io.Combo.Input("diffusion_model", options=diffusion_model_options(), tooltip="Diffusion model from "
                               "models/diffusion_models (or a checkpoint from models/checkpoints)"),
                io.Combo.Input("text_encoder_1", options=tes + [FROM_CHECKPOINT], tooltip="First text encoder from "
                               "models/text_encoders (Flux, SDXL, SD3: CLIP-L; Chroma: T5-XXL; Wan: UMT5-XXL); "
                               f"{FROM_CHECKPOINT}: the checkpoint's own text encoders (the others: none)"),
                io.Combo.Input("text_encoder_2", options=[NONE] + tes, tooltip="Second text encoder (Flux: T5-XXL; "
                               "SDXL, SD3: CLIP-G)"),
                io.Combo.Input("text_encoder_3", options=[NONE] + tes, default=NONE, optional=True,
                               tooltip="Third text encoder (SD3, HiDream: T5-XXL)"),
                io.Combo.Input("text_encoder_4", options=[NONE] + tes, default=NONE, optional=True,
                               tooltip="Fourth text encoder (HiDream: Llama-3.1-8B)"),
                io.Combo.Input("model_type", options=[AUTO] + model_types(), default=AUTO, optional=True,
                               tooltip="Detected from the file, except what the weights cannot tell: Flux Kontext "
                               "(a Flux file), Qwen-Image-Edit, Wan 2.2 5B image-to-video"),
                io.Combo.Input("clip_vision", options=[NONE] + clip_vision_options(), default=NONE, optional=True,
                               tooltip="Wan 2.1 image-to-video and first-last-frame: clip_vision_h from "
                                       "models/clip_vision"),
                io.Float.Input("min_t", default=start("model.min_t"), min=0.0, max=1.0, step=0.005, optional=True,
                               tooltip="Flow models: train only timesteps >= min_t (Wan 2.2 high-noise expert: 0.875 "
                               "t2v, 0.9 i2v)"),
                io.Float.Input("max_t", default=start("model.max_t"), min=0.0, max=1.0, step=0.005, optional=True,
                               tooltip="Flow models: train only timesteps <= max_t (Wan 2.2 low-noise expert: 0.875 "
                               "t2v, 0.9 i2v)"),
                io.Combo.Input("merge_lora", options=[NONE] + folder_paths.get_filename_list("loras"), default=NONE,
                               optional=True, tooltip="A LoRA from models/loras baked into the base weights before "
                               "training (e.g. Z-Image Turbo's training adapter)"),
                io.Combo.Input("vae", options=folder_paths.get_filename_list("vae") + [FROM_CHECKPOINT],
                               tooltip="VAE from models/vae, used to encode the images into latents; "
                               f"{FROM_CHECKPOINT}: the VAE of an all-in-one checkpoint picked as diffusion_model"),
                io.Combo.Input("weight_dtype", options=WEIGHT_DTYPES, default="default", tooltip="Storage dtype of the "
                               "frozen diffusion-model weights; fp8 halves memory"),
                io.Combo.Input("compute_dtype", options=COMPUTE_DTYPES, default=start("model.dtype"), tooltip="Dtype "
                               "the model computes in"),
                io.Combo.Input("timestep_sample_method", options=choices("model.timestep_sample_method"),
                               default=start("model.timestep_sample_method"), optional=True, tooltip="How training "
                               "timesteps are drawn: logit_normal (more in the middle) or uniform"),
                io.Float.Input("sigmoid_scale", default=start("model.sigmoid_scale"), min=0.01, max=100.0, step=0.1,
                               optional=True, tooltip="logit_normal's spread (larger: more timesteps near the ends)"),
                io.Float.Input("shift", default=start("model.shift", off=0.0), min=0.0, max=100.0, step=0.1,
                               optional=True,
                               tooltip="Shift the timesteps toward noise by this factor (0: the model's own)"),
                io.Boolean.Input("flux_shift", default=start("model.flux_shift"), optional=True, tooltip="Flux's "
                                 "resolution-dependent timestep shift"),
                io.Float.Input("guidance", default=start("model.guidance"), min=0.0, max=100.0, step=0.1,
                               optional=True, tooltip="The distilled guidance input trained with (Flux-dev)"),
                io.Boolean.Input("v_pred", default=start("model.v_pred"), optional=True, tooltip="SDXL, SD 1.x, "
                                 "SD 2.x: train v-prediction (else as ComfyUI samples the model)"),
                io.Float.Input("min_snr_gamma", default=start("model.min_snr_gamma", off=0.0), min=0.0, max=100.0,
                               step=0.5, optional=True, tooltip="SDXL: weigh each sample's loss by min(SNR, gamma) / "
                               "SNR (min-SNR weighting; 5 is usual; 0: off)"),
                io.Boolean.Input("debiased_estimation_loss", default=start("model.debiased_estimation_loss"),
                                 optional=True, tooltip="SDXL: weigh each sample's loss by 1 / sqrt(SNR)"),
                io.Boolean.Input("control_start_image", default=True, optional=True, tooltip="Wan Fun-Control: "
                                 "the clip's first frame is the start image with the control (off: the control "
                                 "alone, as WanFunControlToVideo without a start image; stills can train then)"),
                io.Float.Input("unet_lr", default=0.0, min=0.0, max=1.0, step=1e-6, round=1e-8, optional=True,
                               tooltip="SDXL, SD 1.x, SD 2.x: the UNet's learning rate, over the Optimizer node's lr "
                               "(diffusion-pipe's unet_lr; 0: the Optimizer node's lr)"),
                io.Int.Input("max_sequence_length", default=0, min=0, max=4096, optional=True,
                             tooltip="AuraFlow: its T5 tokens cut to this many and padded to it (diffusion-pipe's "
                             "key: 256 for AuraFlow, 768 for Pony V7; 0: ComfyUI's, every token)"),
                io.Int.Input("max_llama3_sequence_length", default=0, min=0, max=4096, optional=True,
                             tooltip="HiDream: its Llama 3 tokens cut to this many and padded to it (0: "
                             "diffusion-pipe's 128)"),
            ],
            outputs=[t.Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, diffusion_model=None):
        # Only the file and its architecture at queue time (ComfyUI repeats a failed check's message once per input
        # named here); whether model_type fits it and the timestep range are checked when the node runs, before
        # Cache and Train. On ComfyUI's event loop: a file whose architecture takes long to tell (a pickled
        # checkpoint, a huge header) is told then too.
        return model_input_error(diffusion_model, queue_time=True) or True

    @classmethod
    def execute(cls, diffusion_model, text_encoder_1, text_encoder_2, vae, weight_dtype,
                compute_dtype, text_encoder_3=NONE, text_encoder_4=NONE, model_type=AUTO, clip_vision=NONE,
                min_t=None, max_t=None, merge_lora=NONE, shift=None, min_snr_gamma=None, control_start_image=True,
                unet_lr=None, max_sequence_length=0, max_llama3_sequence_length=0, **keys) -> io.NodeOutput:
        import folder_paths
        min_t = start("model.min_t") if min_t is None else min_t
        max_t = start("model.max_t") if max_t is None else max_t
        error = model_input_error(diffusion_model, model_type, min_t, max_t)
        if error:
            raise ValueError(error)
        path = model_path(diffusion_model)
        names = (text_encoder_1, text_encoder_2, text_encoder_3, text_encoder_4)
        tes = [folder_paths.get_full_path_or_raise("text_encoders", n) for n in names
               if n not in (NONE, None, FROM_CHECKPOINT)]
        if FROM_CHECKPOINT == text_encoder_1 and tes:
            raise ValueError(f"text_encoder_1 is {FROM_CHECKPOINT!r}: the checkpoint's text encoders are all of them; "
                             "set text_encoder_2 .. 4 to none")
        vision = (None if clip_vision in (NONE, None)
                  else folder_paths.get_full_path_or_raise("clip_vision", clip_vision))
        # timestep_sample_method, sigmoid_scale, flux_shift, guidance, v_pred, debiased_estimation_loss: the keys
        patch = RunPatch.of({**keys, "type": detect(path, model_type), "diffusion_model": path,
                             "vae": None if vae == FROM_CHECKPOINT else folder_paths.get_full_path_or_raise("vae", vae),
                             "text_encoders": tes,   # none (from the checkpoint): the key left empty
                             "dtype": compute_dtype, "diffusion_model_dtype": None if weight_dtype == "default"
                             else weight_dtype, "clip_vision": vision, "min_t": min_t, "max_t": max_t,
                             "shift": shift or None,   # 0: the model's own shift
                             "min_snr_gamma": min_snr_gamma or None,   # 0: off
                             "unet_lr": unet_lr or None,   # 0: the optimizer's lr
                             "max_sequence_length": max_sequence_length or None,   # 0: the model's own
                             "max_llama3_sequence_length": max_llama3_sequence_length or None,
                             "control_start_image": None if control_start_image in (None, True) else False,
                             "merge_adapters": [] if merge_lora in (NONE, None)
                             else [folder_paths.get_full_path_or_raise("loras", merge_lora)]}, "model")
        model_type = patch.get("model.type")
        check_model_patch(patch)    # the architecture's own rules (timestep range, CLIP vision), now
        return io.NodeOutput(patch, ui=ui.PreviewText(parity_text(model_type)))


def check_model_patch(patch: RunPatch) -> None:
    """The Model node's keys as ``[model]``, checked by the preflight the launcher and the CLI run."""
    from ..backend.config import ModelConfig
    from ..backend.preflight import check_checkpoint_parts, check_model
    from ..backend.config.schema import from_dict
    try:
        cfg = from_dict(ModelConfig, patch.table()["model"], file="the Model node", prefix="model")
        check_model(cfg, "the Model node")
        check_checkpoint_parts(cfg)   # "(from the checkpoint)": the file must hold them
    except PipeTrainError as e:
        raise ValueError(str(e)) from None
