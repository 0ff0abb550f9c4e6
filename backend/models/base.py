"""The model adapter interface: one subclass per architecture, in one module (or folder) of its own.

An adapter knows how to load its ComfyUI model, encode images and captions for the cache, split the
network into pipeline layers, and turn a cached batch into first-stage inputs and last-stage labels.
Facts about the architecture are class attributes; the shared modules (loading, tiny files, config, compat,
check-config, parity) read them and hold no table or branch per model type.

What a new model declares (ARCHITECTURE.md, "Adding a model"), in its own module plus one ``registry.ADAPTERS``
line:
1. ``arch`` and ``spec``: the type string, and an ``ArchSpec`` (``spec.py``): the ComfyUI classes its detection
   gives, the diffusion-model config per size and how to build it (tiny files), its text-encoder and VAE kinds,
   with the kinds no other model reads declared there too (``ArchSpec.text_encoder_kinds`` / ``vae_kinds``),
   the first ComfyUI release with its code where its class is older (``min_comfyui``).
2. ``latent_format``, ``lora_block_prefixes``, ``text_fields``: the latent scaling, where LoRAs go, the cached text.
3. ``encode_caption``, ``objective``, ``to_layers``: caching, the training target, the pipeline layers;
   ``reference_forward`` and ``probe_text``: ComfyUI's own forward on the same inputs (parity and tests).
4. Only where they differ from the defaults below: the data facts (video, audio, edit / control inputs), the
   sampling hooks, and diffusion-pipe's names for the model (``dp_aliases``, ``dp_edit_of``, ``dp_file_of`` with
   ``claims_file``, ``dp_lumina_shift``), which ``compat.py`` and check-config read.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError, ModelError
from .losses import Loss
from .spec import ArchSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def loss_mask(labels: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """Masked training's per-element weights, the label after (latents, noise, t) when the feed adds one (a
    float tensor; a bool one last is the regularisation flags ``train/reg_loss.py`` takes off)."""
    return labels[3] if len(labels) > 3 and labels[3].is_floating_point() else None


class ModelAdapter(ABC):
    arch: str
    spec: "ArchSpec"                         # its files and how ComfyUI recognises them (spec.py)
    latent_format: str                       # class name in comfy.latent_formats
    lora_block_prefixes: tuple[str, ...]     # LoRA goes on the linears under these module paths
    text_fields: tuple[str, ...]             # cached text tensors, in the order layers receive them
    text_lengths: bool = False               # collate_text appends each caption's token count (of the first
    #                                          text field) so the layers can mask the zero padding
    spatial_multiple: int = 16               # bucket sides are multiples of this many pixels
    framerate: float | None = None           # video models: frames per second clips are resampled to
    frame_multiple: int = 1                  # video models: clips are frame_multiple k + 1 frames long
    timestep_range: bool = True              # honours [model] min_t / max_t (flow models; not SDXL's DDPM)
    snr_weighting: bool = False              # honours [model] min_snr_gamma / debiased_estimation_loss (SDXL)
    compile_dynamic: bool | None = None      # compile = true: torch.compile's dynamic (None: dynamic from the
                                             # second shape on)
    compiles_checkpoints: bool = True        # compile = true puts each block's checkpoint (and its policy) inside
                                             # the compiled graph
    takes_clip_vision: bool = False          # [model] clip_vision names a CLIP-vision file it encodes (Wan 2.1 i2v)
    takes_control_start_image: bool = False  # [model] control_start_image switches its start image (Fun-Control)
    vace_inputs: bool = False                # [[directory]] control_mask_path / reference_path (Wan VACE)
    parity_dtype: torch.dtype = torch.float64   # the parity check's dtype (parity/check.py): what remains is rounding
    conditioning_fields: tuple[str, ...] = ()  # edit / i2v models: cached tensors the first layer receives
    #                                            after the text fields (encode_conditioning makes them)
    needs_control: bool = False              # edit models: every dataset directory needs a control_path
    max_controls: int = 1                    # edit models: how many control folders control_path may list
    video_control: bool = False              # control models (Wan VACE): a clip's control is a video, read up to
    #                                          the clip's frame bucket (or an image: one frame)
    caption_sees_control: bool = False       # edit models whose text encoder reads the control image with the
    #                                          caption (encode_caption_with_image); cached per caption and image
    memory_format: torch.memory_format = torch.contiguous_format  # how the engine stores 4-D weights in training
    samples_first: bool = True               # every adapted layer's input has the samples on its first dimension
    #                                          (outermost where flattened): diff_output_preservation relies on it
    audio: bool = False                      # trains on audio files (data/audio.py), latents from encode_audio
    unet: bool = False                       # a UNet: [model] unet_lr is its learning rate (diffusion-pipe's SDXL)
    # --- diffusion-pipe's names for this model (compat.py, check-config); its own type string is ours. Each names
    # one type: ``registry.dp_facts`` reads them from the class itself, never from a base class ---
    dp_aliases: tuple[str, ...] = ()         # diffusion-pipe's type strings for this type by another spelling
    dp_edit_of: str = ""                     # the diffusion-pipe type that trains this one when the dataset has
    #                                          control images (control_path): its edit variant
    dp_file_of: str = ""                     # the diffusion-pipe type that names this one too, told apart by the
    #                                          diffusion model's file (``claims_file`` reads its header)
    dp_first_frame_of: str = ""              # the diffusion-pipe type that trains this one when its
    #                                          first_frame_conditioning_p is 1 (LTX-Video's image to video)
    dp_lumina_shift: bool = False            # reads diffusion-pipe's lumina_shift as flux_shift (Lumina 2)
    dp_text_encoder_lora: bool = False       # diffusion-pipe trains LoRAs on its text encoders by default (SDXL:
    #                                          check-config says that here they stay frozen)
    dp_diffusers_lora: bool = False          # diffusion-pipe saves its LoRA by Diffusers' names (Flux's pipeline):
    #                                          init_from_existing reads such a save (``flux.diffusers_lora_parts``)
    dp_token_length_key: str = ""            # the [model] key of diffusion-pipe's caption token length this model
    #                                          reads (AuraFlow's max_sequence_length, HiDream's Llama one)
    dp_diffusers_folder: bool = False        # its Diffusers pipeline folder (diffusers_path, checkpoint_path) is read:
    #                                          ComfyUI's loaders convert each of its components' keys
    dp_folder_pipeline: str = ""             # the model_index.json class prefix of a folder whose transformer is
    #                                          this model's (another model's folder would give the wrong one)
    dp_folder_borrows: tuple[str, ...] = ()  # the text-encoder kinds this model takes from another model's Diffusers
    #                                          folder (diffusers_path), its own transformer coming from a file
    dp_transformer_example: str = ""         # that file's usual name, for the message asking for it
    dp_single_file: bool = False             # its single-file release (single_file_path: transformer and VAE in one
    #                                          file, ComfyUI's checkpoint layout) is read; its Diffusers folder then
    #                                          lends its text encoders only (LTX-Video's)
    dp_ckpt_folder: bool = False             # its official checkpoint folder (ckpt_path) is read (Wan's: transformer
    #                                          shards and VAE .pth in ComfyUI's keys)
    dp_llama3_path: bool = False             # reads diffusion-pipe's llama3_path (a Hugging Face Llama folder) as its
    #                                          Llama text encoder, after the others in text_encoders (HiDream)
    dp_fuse_adapters: bool = False           # reads diffusion-pipe's [adapter] fuse_adapters (LoRAs fused into the
    #                                          base weights before training) as merge_adapters (Flux, Chroma)

    @staticmethod
    def claims_file(shapes: dict, metadata: dict) -> bool:
        """``dp_file_of`` models: whether a diffusion-model file's safetensors header (tensor shapes, metadata; no
        weights read) is this model's rather than the one diffusion-pipe's type names first."""
        return False

    @classmethod
    def check_config(cls, cfg: ModelConfig, file) -> None:
        """What this architecture accepts in ``[model]`` beyond the keys every model has (``preflight`` runs it)."""
        if (cfg.min_t, cfg.max_t) != (0.0, 1.0) and not cls.timestep_range:
            raise ConfigError(f"a {cfg.type} model draws discrete DDPM timesteps; min_t and max_t restrict the "
                              "timesteps of flow-matching models (remove them)", file=file, key="model.min_t")
        for key, value in (("min_snr_gamma", cfg.min_snr_gamma), ("debiased_estimation_loss",
                                                                   cfg.debiased_estimation_loss)):
            if value not in (None, False) and not cls.snr_weighting:
                raise ConfigError(f"a {cfg.type} model has no DDPM noise schedule to weigh by SNR; {key} is for "
                                  "SDXL (remove it)", file=file, key=f"model.{key}")
        if cfg.clip_vision is not None and not cls.takes_clip_vision:
            raise ConfigError(f"a {cfg.type} model takes no CLIP-vision file (Wan 2.1 i2v and flf2v do); "
                              "remove the key", file=file, key="model.clip_vision")
        if cfg.control_start_image is not None and not cls.takes_control_start_image:
            raise ConfigError(f"a {cfg.type} model has no start-image switch (wan_fun_control has); remove the key",
                              file=file, key="model.control_start_image")
        allowed = cls.spec.accepted_text_encoder_types()
        for i, declared in cfg.declared_text_encoder_types():
            if declared.lower() not in allowed:
                raise ConfigError(f"got type = {declared!r}; a {cfg.type} model takes text encoders of type "
                                  f"{' or '.join(repr(a) for a in allowed)}", file=file,
                                  key=f"model.text_encoders[{i}]")

    def __init__(self, cfg: ModelConfig, resolve=lambda p: Path(p)):
        from ..host.runtime import ensure_comfyui
        ensure_comfyui()   # an adapter runs ComfyUI's code: its methods take ``comfy`` as importable
        self.cfg = cfg
        self.resolve = resolve
        self.dtype = DTYPES[cfg.dtype]
        self.patcher = None
        self.criterion = Loss()     # mse until the run sets its loss_type (use_loss)

    # --- files ------------------------------------------------------------------------------
    def model_files(self) -> dict[str, list[Path]]:
        """Each role's files; a role the config names no file for is the diffusion model file, an all-in-one
        checkpoint (``from_checkpoint``), so the cache keys follow that file."""
        model = self.resolve(self.cfg.diffusion_model)
        files = {"diffusion_model": [model], "vae": [self.resolve(self.cfg.vae) if self.cfg.vae else model],
                 "text_encoders": [self.resolve(p) for p in self.cfg.text_encoder_files] or [model]}
        for role, paths in files.items():
            for p in paths:
                if not (p.is_file() or p.is_dir()):   # a folder: a Diffusers component (``model_folders``)
                    raise ModelError(f"[model] {role}: file not found: {p}")
        return files

    # --- caching side -----------------------------------------------------------------------
    def from_checkpoint(self) -> set[str]:
        """The roles read from the diffusion model file, an all-in-one checkpoint (``ModelConfig.from_checkpoint``)."""
        return self.cfg.from_checkpoint()

    def load_vae(self):
        from .checkpoint_file import load_checkpoint_vae
        from .loading import load_vae
        if "vae" in self.from_checkpoint():
            return load_checkpoint_vae(self.model_files()["vae"][0], self.arch)
        return load_vae(self.model_files()["vae"][0])

    def load_text_encoders(self):
        from .checkpoint_file import load_checkpoint_text_encoders
        from .loading import load_text_encoders
        if "text_encoders" in self.from_checkpoint():
            return load_checkpoint_text_encoders(self.model_files()["text_encoders"][0], self.arch, torch.float32)
        return load_text_encoders(self.model_files()["text_encoders"], self.arch, torch.float32)

    def encode_images(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, H, W, 3] in 0..1 -> latents scaled for the diffusion model (float32, CPU)."""
        import comfy.latent_formats
        fmt = getattr(comfy.latent_formats, self.latent_format)()
        return fmt.process_in(vae.encode(pixels).float()).cpu()

    def encode_video(self, vae, frames: torch.Tensor) -> torch.Tensor:
        """Video models: frames [F, H, W, 3] in 0..1 -> one latent [C, T, h, w] (float32, CPU)."""
        raise ModelError(f"{self.arch} trains on images only")

    def encode_conditioning(self, vae, media: torch.Tensor, control: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Edit and i2v models: the ``conditioning_fields`` of one sample (no batch dimension), from the same
        pixels its latent was encoded from (``media``: an image [1, H, W, 3] or a clip's frames [F, H, W, 3])
        and its paired control images at the same bucket ([N, H, W, 3], one per folder of control_path, or None
        without one; with ``video_control`` a clip's control video [F', H, W, 3], F' <= F)."""
        raise ModelError(f"{self.arch} declares conditioning_fields but does not encode them")

    @abstractmethod
    def encode_caption(self, clip, caption: str) -> dict[str, torch.Tensor]:
        """One caption -> the tensors named in ``text_fields`` (no batch dimension)."""

    def encode_caption_with_image(self, clip, caption: str, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """``caption_sees_control`` models: one caption read together with its control images ([N, H, W, 3] at
        the sample's bucket, in control_path's order) -> the tensors named in ``text_fields``."""
        raise ModelError(f"{self.arch} declares caption_sees_control but does not encode captions with images")

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Stack per-sample text tensors; sequences are zero-padded to the longest in the batch (then, with
        ``text_lengths``, each caption's token count [B])."""
        out = []
        for name in self.text_fields:
            ts = [it[name] for it in items]
            if ts[0].ndim >= 2:
                n = max(t.shape[0] for t in ts)
                ts = [torch.nn.functional.pad(t, (0, 0) * (t.ndim - 1) + (0, n - t.shape[0])) for t in ts]
            out.append(torch.stack(ts))
        if self.text_lengths:
            out.append(torch.tensor([it[self.text_fields[0]].shape[0] for it in items]))
        return out

    # --- training side ----------------------------------------------------------------------
    def load_diffusion_model(self):
        from .loading import load_diffusion_model, merge_loras
        weight_dtype = DTYPES[self.cfg.diffusion_model_dtype] if self.cfg.diffusion_model_dtype else self.dtype
        self.use_model(load_diffusion_model(self.model_files()["diffusion_model"][0], weight_dtype))
        if self.cfg.merge_adapters:
            merge_loras(self.patcher, [(self.resolve(p), weight) for p, weight in self.cfg.merged_loras])
        return self.patcher

    def use_model(self, patcher) -> None:
        """Train (or check) ``patcher``'s model from now on: ComfyUI's ModelPatcher as ``load_diffusion_model``
        loads it from the config's file, or one built in memory (``loading.build_model``: benchmarks, tests) or
        patched with a LoRA (``parity/verify.py``)."""
        self.patcher = patcher

    @property
    def diffusion_model(self) -> nn.Module:
        if self.patcher is None:
            raise ModelError("load_diffusion_model() first")
        return self.patcher.model.diffusion_model

    @property
    def model_sampling(self):
        return self.patcher.model.model_sampling

    @abstractmethod
    def objective(self): ...

    def flow_matching(self, default_shift: float | None = None, default_multiplier: float = 1.0):
        """The ``[model]`` table's rectified flow, its network timestep multiplier ComfyUI's model_sampling's
        once the model is loaded (``default_multiplier``, the architecture's, before)."""
        from .objectives import FlowMatching
        multiplier = self.model_sampling.multiplier if self.patcher is not None else default_multiplier
        return FlowMatching.from_model_config(self.cfg, default_shift=default_shift, multiplier=multiplier)

    @abstractmethod
    def to_layers(self) -> list[nn.Module]:
        """The network as a flat list of pipeline layers (each maps a tuple of tensors to a tuple), built without
        activation checkpointing: the run applies its mode afterwards (``checkpointing.apply_checkpointing``)."""

    def compile(self, layers: list[nn.Module], checkpoint_inside: bool = True,
                memory_budget: float | None = None, cuda_graphs: bool = False) -> int:
        """``compile = true``: compile the layers' transformer blocks in place (compiling.py); returns how many
        regions were compiled. By default each layer's ``block_forward``, its checkpoint inside the graph unless
        ``checkpoint_inside`` is False; ``memory_budget``: ``activation_memory_budget``. ``cuda_graphs``: the run
        allows replaying compiled regions as CUDA graphs (see ``compiling.cuda_graphs_allowed``); an adapter whose
        steps wait on kernel launches uses it, the default ignores it."""
        from .compiling import compile_blocks
        return compile_blocks(layers, checkpoint_inside, dynamic=self.compile_dynamic, memory_budget=memory_budget)

    def seq_len(self, latent: torch.Tensor) -> int:
        """The token count a resolution-dependent timestep shift reads (Flux's: 2x2 patches of one frame)."""
        return latent.shape[-1] * latent.shape[-2] // 4

    def layer_cost(self, layer: nn.Module) -> float:
        """Relative compute of a layer, for balancing pipeline stages (override per family)."""
        return float(getattr(layer, "cost", 0.05))

    def conditioning_options(self) -> dict:
        """Settings the cached conditioning depends on beyond its files (they enter its cache key); {}: none."""
        return {}

    def text_options(self) -> dict:
        """Settings a caption's cached embedding depends on beyond its text and files (its token length: they
        enter its cache key); {}: none."""
        return {}

    def extra_noise_shape(self, payload: dict) -> tuple[int, ...] | None:
        """The shape of further noise a sample's first layer takes after its conditioning (VACE: the noise of the
        reference image's latent frame), drawn by the feed (``train/feed.py``) from the sample's own seed; None:
        none."""
        return None

    def use_loss(self, loss) -> None:
        """Compare prediction and target with ``loss`` (``losses.Loss``: the run's loss_type) from now on."""
        self.criterion = loss

    def loss(self, pred: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
        latents, noise, t = labels[:3]
        objective = self.objective()
        return self.criterion(pred, objective.target(latents, noise, t), objective.loss_weights(t), loss_mask(labels))

    def preservation_loss(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """diff_output_preservation (train/preservation.py): the adapted prediction against the base model's on the
        same input, by the run's loss_type, unweighted: both are predictions of the same target."""
        return self.criterion(pred, target)

    def probe_latent(self, generator: torch.Generator, size: tuple[int, int] = (8, 8)) -> torch.Tensor:
        """A random clean latent [1, C, H, W] (video models: [1, C, T, H, W]) for checks."""
        import comfy.latent_formats
        channels = getattr(comfy.latent_formats, self.latent_format)().latent_channels
        return torch.randn(1, channels, *size, generator=generator)

    # --- sampling with ComfyUI (backend/sampling/render.py) -----------------------------------------------
    def sample_conditioning(self, text: dict[str, torch.Tensor], guidance: float) -> list:
        """ComfyUI's CONDITIONING for one cached caption: the first text field is the cross-attention
        conditioning, a ``pooled`` field the pooled vector; ``guidance`` is Flux-dev's distilled guidance."""
        extra = {"guidance": guidance}
        if "pooled" in text:
            extra["pooled_output"] = text["pooled"][None]
        return [[text[self.text_fields[0]][None], extra]]

    def empty_latent(self, width: int, height: int, frames: int = 1) -> torch.Tensor:
        """ComfyUI's empty latent of a sample (video models: a clip of ``frames`` frames; image models: a still)."""
        import comfy.latent_formats
        channels = getattr(comfy.latent_formats, self.latent_format)().latent_channels
        return torch.zeros(1, channels, height // 8, width // 8)

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a ``frames``-frame clip (the VAE's causal first frame, then ``frame_multiple`` a latent)."""
        return (frames - 1) // self.frame_multiple + 1

    takes_start_image: bool = False          # i2v models: samples start from an image ([samples] start_image)

    def start_conditioning(self, vae, positive: list, negative: list, width: int, height: int, frames: int,
                           images: list[torch.Tensor]) -> tuple[list, list, dict]:
        """i2v models: (positive, negative, latent) as the ComfyUI node this model samples with builds them from
        ``images`` (the start image [1, H, W, 3]; wan_flf2v: also the end image)."""
        raise NotImplementedError(f"{self.arch} samples without a start image")

    def control_conditioning(self, vae, positive: list, negative: list, width: int, height: int, frames: int,
                             control: torch.Tensor, **inputs: torch.Tensor) -> tuple[list, list, dict, int]:
        """Control-video models (``video_control``): (positive, negative, latent, trim) as the ComfyUI node this
        model samples with builds them from the ``control`` frames [F, H, W, 3] and the further ``inputs`` its
        training encodes (wan_vace: control_mask, reference; wan_fun_control: start_image); ``trim``: latent frames
        in front that are no part of the clip (a reference's, dropped after sampling as ComfyUI's TrimVideoLatent)."""
        raise NotImplementedError(f"{self.arch} samples without a control video")

    def reference_forward(self, x_t, t, text: list[torch.Tensor]) -> torch.Tensor:
        """ComfyUI's own forward of the diffusion model on the same inputs the layers see (for tests)."""
        raise NotImplementedError


class VideoLatents:
    """Mixin for models with a video VAE (5-D latents [B, C, T, h, w]): an image is a one-frame clip, encoded
    one at a time (ComfyUI's video VAEs would take a batch of images as the frames of one clip)."""

    def encode_images(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.encode_video(vae, pixels[i:i + 1])[None] for i in range(pixels.shape[0])])

    def encode_video(self, vae, frames: torch.Tensor) -> torch.Tensor:
        import comfy.latent_formats
        fmt = getattr(comfy.latent_formats, self.latent_format)()
        return fmt.process_in(vae.encode(frames).float()).cpu()[0]


class GivenFirstFrame:
    """Mixin for the i2v modes ComfyUI samples with the clip's first latent frame given clean (Wan 2.2 5B's
    ``Wan22ImageToVideoLatent``, LTX-Video's ``LTXVImgToVideo``): it is cached as ``first_frame`` (the first pixel
    frame encoded alone, as those nodes encode their image), and the loss leaves that frame out, since ComfyUI's
    sampler puts the given latent over its prediction. The layers take ``first_frame`` with timestep 0."""
    conditioning_fields = ("first_frame",)
    still_type: str   # the model type that trains still images on the same file (named in the error)

    def encode_conditioning(self, vae, media, control):
        if media.shape[0] < 2:
            raise ModelError(f"{self.arch} trains on videos only (the first frame conditions the others); "
                             f"this dataset has a still image: train stills with type '{self.still_type}'")
        return {"first_frame": self.encode_video(vae, media[:1])}

    def loss(self, pred, labels):
        latents, noise, t = labels[:3]
        objective = self.objective()
        target = objective.target(latents, noise, t)
        mask = loss_mask(labels)   # [B, 1, 1, H, W]: the same weights on every frame
        return self.criterion(pred[:, :, 1:], target[:, :, 1:], objective.loss_weights(t),
                              None if mask is None else mask.expand(-1, -1, pred.shape[2], -1, -1)[:, :, 1:])

    def preservation_loss(self, pred, target):
        return self.criterion(pred[:, :, 1:], target[:, :, 1:])   # the given frame, as in ``loss``

    def probe_text(self, generator):
        """The caption's tensors, then a given first frame (for ``check_lora`` and the parity check)."""
        return [*super().probe_text(generator), self.probe_latent(generator)[:, :, :1]]
