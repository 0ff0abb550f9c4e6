# SPDX-License-Identifier: GPL-3.0-or-later
"""Dataset and Model: where the images are and which model files to train on."""
from __future__ import annotations

from pathlib import Path

from comfy_api.latest import io

from ..backend.errors import PipeTrainError
from ..launcher.build import check_dataset_folder
from ..launcher.specs import DatasetSpec, DirectorySpec, ModelSpec
from . import types as t

WEIGHT_DTYPES = ["default", "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]
COMPUTE_DTYPES = ["bfloat16", "float16", "float32"]
CKPT_PREFIX = "checkpoints/"
NONE = "none"


def dataset_folder(folder: str) -> Path:
    import folder_paths
    p = Path(folder.strip()).expanduser()
    return (p if p.is_absolute() else Path(folder_paths.get_input_directory()) / p).resolve()


def parse_frame_buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in str(text).replace(";", ",").split(",") if v.strip())
    except ValueError:
        raise ValueError(f"frame_buckets {text!r}: write whole numbers separated by commas, e.g. 1, 33") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"frame_buckets {text!r}: each must be 1 or more")
    return values


def parse_resolutions(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in str(text).replace(";", ",").split(",") if v.strip())
    except ValueError:
        raise ValueError(f"resolutions {text!r}: write whole numbers separated by commas, e.g. 512, 768") from None
    if not values or any(v < 64 or v % 64 for v in values):
        raise ValueError(f"resolutions {text!r}: each must be a multiple of 64, at least 64")
    return values


class DatasetNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainDataset", display_name="PipeTrain Dataset", category=t.CATEGORY,
            description="A folder of images with same-name caption files. Chain several into one dataset.",
            inputs=[
                io.String.Input("folder", default="", tooltip="Folder of images (+ captions): a path under ComfyUI's "
                                "input directory, or an absolute path"),
                io.String.Input("resolutions", default="512", tooltip="Training side length(s) in pixels, comma "
                                "separated multiples of 64; each image trains at every resolution"),
                io.Boolean.Input("enable_ar_bucket", default=True, tooltip="Group images by aspect ratio instead of "
                                 "cropping them square"),
                io.Float.Input("min_ar", default=0.5, min=0.1, max=1.0, step=0.05, tooltip="Smallest aspect ratio "
                               "(width/height) of a bucket"),
                io.Float.Input("max_ar", default=2.0, min=1.0, max=10.0, step=0.05, tooltip="Largest aspect ratio "
                               "(width/height) of a bucket"),
                io.Int.Input("num_ar_buckets", default=7, min=1, max=64, tooltip="Number of aspect-ratio buckets"),
                io.Int.Input("num_repeats", default=1, min=1, max=1000, tooltip="How often each image of this folder "
                             "is seen per epoch"),
                io.String.Input("caption_extension", default=".txt", tooltip="Extension of the caption file beside "
                                "each image (a missing caption trains with an empty one)"),
                io.String.Input("caption_prefix", optional=True, default="", tooltip="Text put before every caption of this "
                                "folder, e.g. a trigger word 'sks, ' (outside any tag shuffling)"),
                io.Boolean.Input("shuffle_tags", optional=True, default=False, tooltip="Train on a copy of each caption with its "
                                 "comma-separated tags shuffled (the same as 1 shuffled variant)"),
                io.Int.Input("cache_shuffle_num", optional=True, default=0, min=0, max=64, tooltip="Tag-shuffled variants of each "
                             "caption, each trained as its own example (0: the caption as written)"),
                io.String.Input("frame_buckets", optional=True, default="1", tooltip="Video models: clip lengths in frames, comma "
                                "separated (Wan: 4k+1, e.g. 1, 33, 65); each video trains as the longest it fills"),
                io.Float.Input("uncond_fraction", optional=True, default=0.0, min=0.0, max=0.99, step=0.01, tooltip="Caption "
                               "dropout: train this fraction of samples with the empty caption (the run uses the "
                               "training dataset's value; an eval dataset's is ignored)"),
                io.String.Input("control_folder", optional=True, default="", tooltip="Edit models (Flux Kontext, "
                                "Qwen-Image-Edit): the folder of control images, each named like its training "
                                "image (a.png <-> a.jpg); under ComfyUI's input directory or an absolute path. "
                                "Leave empty for other models"),
                t.Dataset.Input("previous", optional=True, tooltip="Another PipeTrain Dataset to add this folder to"),
            ],
            outputs=[t.Dataset.Output(display_name="dataset")],
        )

    @classmethod
    def validate_inputs(cls, folder=None, resolutions=None, caption_extension=None, frame_buckets=None,
                        control_folder=None):
        try:
            if folder is not None:
                check_dataset_folder(dataset_folder(folder), caption_extension or ".txt")
            if control_folder and control_folder.strip() and not dataset_folder(control_folder).is_dir():
                return (f"control_folder {control_folder!r}: {dataset_folder(control_folder)} is not a folder; pick "
                        "the folder of control images under ComfyUI's input directory or type an absolute path")
            if resolutions is not None:
                parse_resolutions(resolutions)
            if frame_buckets is not None:
                parse_frame_buckets(frame_buckets)
        except (PipeTrainError, ValueError) as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, folder, resolutions, enable_ar_bucket, min_ar, max_ar, num_ar_buckets, num_repeats,
                caption_extension, caption_prefix="", shuffle_tags=False, cache_shuffle_num=0, frame_buckets="1",
                uncond_fraction=0.0, control_folder="", previous=None) -> io.NodeOutput:
        res = parse_resolutions(resolutions)
        ext = caption_extension if caption_extension.startswith(".") else "." + caption_extension
        control = str(dataset_folder(control_folder)) if control_folder.strip() else ""
        directory = DirectorySpec(str(dataset_folder(folder)), num_repeats, res, ext, caption_prefix, shuffle_tags,
                                  cache_shuffle_num, parse_frame_buckets(frame_buckets), control)
        spec = DatasetSpec((directory,), res, enable_ar_bucket, min_ar, max_ar, num_ar_buckets, uncond_fraction)
        return io.NodeOutput(previous.plus(spec) if previous is not None else spec)


def diffusion_model_options() -> list[str]:
    import folder_paths
    return (folder_paths.get_filename_list("diffusion_models")
            + [CKPT_PREFIX + n for n in folder_paths.get_filename_list("checkpoints")])


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


class ModelNode(io.ComfyNode):
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
                io.Combo.Input("text_encoder_1", options=tes, tooltip="First text encoder from models/text_encoders "
                               "(Flux, SDXL, SD3: CLIP-L; Chroma: T5-XXL; Wan: UMT5-XXL)"),
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
                               tooltip="Wan 2.1 image-to-video: clip_vision_h from models/clip_vision"),
                io.Float.Input("min_t", default=0.0, min=0.0, max=1.0, step=0.005, optional=True,
                               tooltip="Train only timesteps >= min_t (Wan 2.2 high-noise expert: 0.875 t2v, 0.9 i2v)"),
                io.Float.Input("max_t", default=1.0, min=0.0, max=1.0, step=0.005, optional=True,
                               tooltip="Train only timesteps <= max_t (Wan 2.2 low-noise expert: 0.875 t2v, 0.9 i2v)"),
                io.Combo.Input("merge_lora", options=[NONE] + folder_paths.get_filename_list("loras"), default=NONE,
                               optional=True, tooltip="A LoRA from models/loras baked into the base weights before "
                               "training (e.g. Z-Image Turbo's training adapter)"),
                io.Combo.Input("vae", options=folder_paths.get_filename_list("vae"), tooltip="VAE from models/vae, "
                               "used to encode the images into latents"),
                io.Combo.Input("weight_dtype", options=WEIGHT_DTYPES, default="default", tooltip="Storage dtype of the "
                               "frozen diffusion-model weights; fp8 halves memory"),
                io.Combo.Input("compute_dtype", options=COMPUTE_DTYPES, default="bfloat16", tooltip="Dtype the "
                               "model computes in"),
            ],
            outputs=[t.Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, diffusion_model=None, model_type=AUTO, min_t=0.0, max_t=1.0):
        from ..backend.errors import ModelError
        if min_t is not None and max_t is not None and min_t >= max_t:
            return f"min_t ({min_t}) must be below max_t ({max_t})"
        name = diffusion_model
        if name is None:
            return True
        path = model_path(name)
        if path is None:
            return f"model file {name} not found in models/diffusion_models or models/checkpoints"
        try:
            detect(path, model_type)
        except (ModelError, ValueError) as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, diffusion_model, text_encoder_1, text_encoder_2, vae, weight_dtype,
                compute_dtype, text_encoder_3=NONE, text_encoder_4=NONE, model_type=AUTO, clip_vision=NONE,
                min_t=0.0, max_t=1.0, merge_lora=NONE) -> io.NodeOutput:
        import folder_paths
        path = model_path(diffusion_model)
        names = (text_encoder_1, text_encoder_2, text_encoder_3, text_encoder_4)
        tes = [folder_paths.get_full_path_or_raise("text_encoders", n) for n in names if n not in (NONE, None)]
        vision = None if clip_vision in (NONE, None) else folder_paths.get_full_path_or_raise("clip_vision", clip_vision)
        spec = ModelSpec(detect(path, model_type), path, folder_paths.get_full_path_or_raise("vae", vae), tuple(tes),
                         compute_dtype, None if weight_dtype == "default" else weight_dtype, vision,
                         None if not min_t else min_t, None if max_t in (None, 1.0) else max_t,
                         () if merge_lora in (NONE, None) else (folder_paths.get_full_path_or_raise("loras", merge_lora),))
        return io.NodeOutput(spec)
