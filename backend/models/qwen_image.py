"""Qwen-Image and Qwen-Image-Edit through ComfyUI's ``comfy.ldm.qwen_image.model.QwenImageTransformer2DModel``.

Latents are 5-D [B, 16, 1, H, W]: Qwen-Image's VAE is ComfyUI's Wan 2.1 VAE class (``comfy.ldm.wan.vae``) with
the ``Wan21`` latent format, and an image is a one-frame clip, as ComfyUI feeds its QwenImage model. Text is
Qwen2.5-VL-7B's last hidden state after ComfyUI's chat template, with the template's leading tokens dropped by
ComfyUI's own encoder (``comfy.text_encoders.qwen_image``).

ComfyUI's ``QwenImageTransformerBlock`` adds its residuals out of place, so the layers run ComfyUI's own blocks
(joint attention routed to SDPA); what is re-stated is only ``_forward``'s loop:

    QwenInput        patchify (+ each reference latent's tokens for Edit), RoPE over [text, image, refs],
                     img_in, txt_norm + txt_in, the timestep embedding       -> (img, txt, temb, pe, hw, lengths)
    QwenBlock  xN    transformer_blocks[i](img, txt, temb, pe); the last one's text stream feeds nothing
    QwenOutput       norm_out, proj_out on the noisy image's tokens, unpatchify, crop

The timestep embedding and RoPE table come from frozen weights and travel bit-cast to integers. Captions of
different lengths in one micro-batch are zero-padded and masked as keys, so each sample trains as ComfyUI runs
it alone. Training is rectified flow (target noise - x0, logit-normal t by default) with ComfyUI's sampling
shift for Qwen-Image unless ``shift`` is set: ComfyUI's ``ModelSamplingFlux`` with shift 1.15 gives
sigma = e^1.15 / (e^1.15 + 1/t - 1), i.e. a constant shift of e^1.15 (~3.16); the network takes t itself
(ComfyUI's multiplier 1; its timestep projection scales by 1000 inside).

Qwen-Image-Edit is the same network with the control image's latent appended as extra image tokens (ComfyUI's
``ref_latents``, RoPE index 1). Its caption is read together with the control image, as ComfyUI's
``TextEncodeQwenImageEditPlus`` reads prompt and ``image1``: "Picture 1: " and the vision tokens before the
caption, the edit system prompt, and the image (cropped to the sample's bucket) scaled to 384x384 pixels'
area for Qwen2.5-VL's vision tower. Samples read their prompts with the same image they edit.

Qwen-Image-Edit-2509 (``qwen_image_edit_plus``) takes up to three control images a sample, as
``TextEncodeQwenImageEditPlus`` takes image1..image3: control_path lists one folder per image; their latents are
reference tokens at RoPE index 1, 2, 3 (cached together as ``references`` [N, 16, 1, h, w]), and the caption is read
with every image ("Picture 1: ... Picture 2: ..." before it). ComfyUI's node encodes the reference latents at about
1024x1024 pixels' area; here each is encoded at the sample's bucket, as diffusion-pipe resizes control images.

LoRA goes on every linear of the transformer blocks (both streams' q/k/v/out, MLPs and modulations) except the
last block's text queries and outputs (``attn.add_q_proj``, ``attn.to_add_out``, ``txt_mlp``), whose result
ComfyUI's forward discards.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .attention import sdpa_transformer_options, text_key_mask
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import BlockLayer
from .objectives import FlowMatching
from .encoders import TEXT_ENCODERS
from .spec import ArchSpec, comfy_diffusion_model

QWEN_SHIFT = math.exp(1.15)   # ComfyUI's sampling_settings for QwenImage: ModelSamplingFlux, shift (mu) 1.15


def qwen_image_config(num_layers: int, **widths) -> dict:
    """The ``unet_config`` ComfyUI's detection derives from a Qwen-Image checkpoint (it reads only the input
    channels and the block count; the widths are the class defaults: 24 heads of 128, text 3584)."""
    return {"image_model": "qwen_image", "in_channels": 64, "num_layers": num_layers, **widths}


# full: Qwen-Image (20B), as ComfyUI detects it. tiny: 2 blocks of 2 heads of 128 (the real RoPE axes) taking
# the tiny Qwen2.5-VL's width; ComfyUI cannot see widths, so tiny files carry this config in their metadata.
QWEN_CONFIGS = {
    "full": qwen_image_config(60),
    "tiny": qwen_image_config(2, num_attention_heads=2,
                              joint_attention_dim=TEXT_ENCODERS["qwen25_7b"].tiny["hidden_size"]),
}
# the last block's modules that reach the output: the text stream there only gives keys and values to the
# image tokens (its queries, attention output and MLP feed nothing)
LAST_BLOCK_LIVE = ("img_mod", "txt_mod", "img_mlp", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_k_proj",
                   "attn.add_v_proj", "attn.to_out")
VISION_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"
VISION_PIXELS = 384 * 384   # TextEncodeQwenImageEditPlus: the area images are scaled to for the vision tower


def qwen_config(size: str) -> dict:
    return dict(QWEN_CONFIGS["full" if size == "full" else "tiny"])


build_qwen_image = comfy_diffusion_model("comfy.ldm.qwen_image.model:QwenImageTransformer2DModel")


def _edit_files_look_like_qwen_image(unet_config: dict) -> bool:
    return False   # same layout: ComfyUI's detection names such a file qwen_image; the edit type is chosen


QWEN_IMAGE_SPEC = ArchSpec(
    title="Qwen-Image", comfy_configs=("QwenImage",), unet_config=qwen_config, build=build_qwen_image,
    detected_sizes=("full",), text_encoders=("qwen25_7b",), clip_type="QWEN_IMAGE", vae="wan21",
    example_file="qwen_image_bf16.safetensors")
QWEN_IMAGE_EDIT_SPEC = ArchSpec(
    title="Qwen-Image-Edit", comfy_configs=("QwenImage",), unet_config=qwen_config, build=build_qwen_image,
    detected_sizes=("full",), text_encoders=("qwen25_7b",), clip_type="QWEN_IMAGE", vae="wan21",
    example_file="qwen_image_edit_bf16.safetensors", accepts=_edit_files_look_like_qwen_image,
    text_encoders_read_images=True)
QWEN_IMAGE_EDIT_PLUS_SPEC = dataclasses.replace(QWEN_IMAGE_EDIT_SPEC, title="Qwen-Image-Edit-2509",
                                                example_file="qwen_image_edit_2509_bf16.safetensors")
PLUS_IMAGES = 3             # TextEncodeQwenImageEditPlus's image1..image3


def attention_options(key_mask: torch.Tensor | None) -> dict:
    """``transformer_options`` routing ComfyUI's attention to SDPA with ``key_mask`` (QwenImage's attention
    passes its own, always None, mask positionally)."""
    if key_mask is None:
        return sdpa_transformer_options()

    def masked(func, q, k, v, heads, mask=None, *args, **kwargs):
        from comfy.ldm.modules.attention import attention_pytorch
        return attention_pytorch(q, k, v, heads, key_mask if mask is None else mask, *args, **kwargs)
    return {"optimized_attention_override": masked}


class QwenInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the input modules become children: the blocks belong to other layers
        self.img_in, self.txt_in, self.txt_norm = dm.img_in, dm.txt_in, dm.txt_norm
        self.time_text_embed, self.pe_embedder = dm.time_text_embed, dm.pe_embedder
        self._process_img = dm.process_img   # patchify and position ids (no weights)
        self.patch_size, self.objective, self.dtype = dm.patch_size, objective, dtype

    def run(self, latents, noise, t, context, text_lengths, *references):
        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        img, img_ids, _ = self._process_img(x)
        for index, ref in enumerate(references, start=1):   # ComfyUI's default "index" reference method
            ref_img, ref_ids, _ = self._process_img(ref.to(self.dtype), index=index)
            img, img_ids = torch.cat([img, ref_img], dim=1), torch.cat([img_ids, ref_ids], dim=1)
        b, h, w, ps = x.shape[0], x.shape[-2], x.shape[-1], self.patch_size
        txt_start = round(max(((w + ps // 2) // ps) // 2, ((h + ps // 2) // ps) // 2))
        txt_ids = torch.arange(txt_start, txt_start + context.shape[1], device=x.device)
        txt_ids = txt_ids.reshape(1, -1, 1).repeat(b, 1, 3)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1)).to(x.dtype).contiguous()
        img = self.img_in(img)
        txt = self.txt_in(self.txt_norm(context.to(self.dtype)))
        temb = self.time_text_embed(self.objective.model_timestep(t), img)
        hw = sizes(h, w)
        return with_grad(img), with_grad(txt), hide(temb), hide(pe), hw, text_lengths


class QwenBlock(BlockLayer):
    def __init__(self, block, dtype, last: bool):
        super().__init__(block, dtype)
        self.last = last

    def block_forward(self, img, txt, temb, pe, text_lengths):
        mask = text_key_mask(text_lengths, txt.shape[1], img.shape[1])
        txt, img = self.block(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=None,
                              temb=reveal(temb, self.dtype), image_rotary_emb=reveal(pe, self.dtype),
                              transformer_options=attention_options(mask))
        return img, txt

    def run(self, img, txt, temb, pe, hw, text_lengths):
        img, txt = self.checkpointed(img, txt, temb, pe, text_lengths)
        if self.last:   # ComfyUI's forward discards the text stream after the last block
            return img, temb, pe, hw, text_lengths
        return img, txt, temb, pe, hw, text_lengths


class QwenOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.norm_out, self.proj_out, self.patch_size, self.dtype = dm.norm_out, dm.proj_out, dm.patch_size, dtype

    def run(self, img, temb, pe, hw, text_lengths):
        h, w, ps = int(hw[0]), int(hw[1]), self.patch_size
        h_len, w_len = (h + ps - 1) // ps, (w + ps - 1) // ps      # pad_to_patch_size's grid
        out = self.proj_out(self.norm_out(img[:, :h_len * w_len], reveal(temb, self.dtype)))
        out = out.view(out.shape[0], h_len, w_len, -1, ps, ps).permute(0, 3, 1, 4, 2, 5)
        out = out.reshape(out.shape[0], out.shape[1], 1, h_len * ps, w_len * ps)[..., :h, :w]
        return out.to(torch.promote_types(out.dtype, torch.float32))


class QwenImageAdapter(ModelAdapter):
    dp_diffusers_folder = True
    dp_folder_pipeline = "QwenImage"
    arch = "qwen_image"
    spec = QWEN_IMAGE_SPEC
    latent_format = "Wan21"
    text_fields = ("context",)
    text_lengths = True        # the layers mask the zero padding of the text tokens

    @property
    def lora_block_prefixes(self) -> tuple[str, ...]:
        """Every block's linears but the last block's text queries and outputs (they reach nothing)."""
        if self.patcher is None:
            return ("transformer_blocks",)
        last = len(self.diffusion_model.transformer_blocks) - 1
        return (*(f"transformer_blocks.{i}" for i in range(last)),
                *(f"transformer_blocks.{last}.{name}" for name in LAST_BLOCK_LIVE))

    # --- caching --------------------------------------------------------------------------------
    def _encode_one_frame(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """[B, H, W, 3] -> [B, 16, 1, h, w]: each image a one-frame clip (ComfyUI's Wan VAE would take a batch
        of images as the frames of one video)."""
        import comfy.latent_formats
        fmt = getattr(comfy.latent_formats, self.latent_format)()
        return torch.cat([fmt.process_in(vae.encode(pixels[i:i + 1]).float()).cpu() for i in range(pixels.shape[0])])

    def encode_images(self, vae, pixels):
        return self._encode_one_frame(vae, pixels)

    def tokenize(self, clip, caption: str):
        return clip.tokenize(caption)

    def encode_caption(self, clip, caption):
        out = clip.encode_from_tokens(self.tokenize(clip, caption), return_dict=True)
        return {"context": out["cond"][0].float().cpu()}

    # --- training -------------------------------------------------------------------------------
    def objective(self):
        return FlowMatching.from_model_config(self.cfg, default_shift=QWEN_SHIFT, multiplier=1.0)

    def to_layers(self):
        dm = self.diffusion_model
        blocks = list(dm.transformer_blocks)
        layers: list[nn.Module] = [QwenInput(dm, self.objective(), self.dtype)]
        layers += [QwenBlock(b, self.dtype, i == len(blocks) - 1) for i, b in enumerate(blocks)]
        layers.append(QwenOutput(dm, self.dtype))
        return layers

    # --- sampling and checks --------------------------------------------------------------------
    def sample_conditioning(self, text, guidance):
        return [[text["context"][None], {}]]   # no distilled guidance input

    def empty_latent(self, width, height):
        return torch.zeros(1, 16, 1, height // 8, width // 8)

    def probe_latent(self, generator, size=(8, 8)):
        return torch.randn(1, 16, 1, *size, generator=generator)

    def probe_text(self, generator):
        tokens = 12
        width = self.diffusion_model.txt_in.in_features
        return [torch.randn(1, tokens, width, generator=generator), torch.tensor([tokens])]

    def comfy_kwargs(self, extra: list[torch.Tensor], i: int) -> dict:
        """ComfyUI forward keyword arguments for sample ``i`` from the tensors after the text fields."""
        return {}

    def reference_forward(self, x_t, t, text):
        """ComfyUI's QwenImage forward, one sample at a time with its unpadded caption."""
        context, lengths, *extra = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t)
        outs = []
        for i in range(x_t.shape[0]):
            outs.append(dm(x_t[i:i + 1].to(self.dtype), timestep[i:i + 1],
                           context[i:i + 1, :int(lengths[i])].to(self.dtype), **self.comfy_kwargs(extra, i)))
        return torch.cat(outs)


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit: the control image's latent goes in as reference tokens (``ref_latents``)."""
    dp_diffusers_folder = True
    dp_folder_pipeline = "QwenImage"
    arch = "qwen_image_edit"
    dp_edit_of = "qwen_image"
    spec = QWEN_IMAGE_EDIT_SPEC
    conditioning_fields = ("reference",)
    needs_control = True
    caption_sees_control = True

    def encode_conditioning(self, vae, media, control):
        return {"reference": self._encode_one_frame(vae, control)[0]}

    def tokenize(self, clip, caption, images=()):
        # ComfyUI's edit system prompt; TextEncodeQwenImageEditPlus puts the vision tokens in the user's turn
        template = clip.tokenizer.llama_template_images.replace(VISION_TOKENS, "")
        prompt = "".join(f"Picture {i}: {VISION_TOKENS}" for i in range(1, len(images) + 1)) + caption
        return clip.tokenize(prompt, images=list(images), llama_template=template)

    def encode_caption_with_image(self, clip, caption, image):
        """Each control image ([N, H, W, 3]) scaled to the vision tower's area, as the edit node scales each input."""
        import comfy.utils

        vision = []
        for samples in image.movedim(-1, 1).split(1):
            scale = math.sqrt(VISION_PIXELS / (samples.shape[2] * samples.shape[3]))
            vision.append(comfy.utils.common_upscale(samples, round(samples.shape[3] * scale),
                                                     round(samples.shape[2] * scale), "area", "disabled")
                          .movedim(1, -1)[..., :3])
        out = clip.encode_from_tokens(self.tokenize(clip, caption, vision), return_dict=True)
        return {"context": out["cond"][0].float().cpu()}

    def probe_text(self, generator):
        return [*super().probe_text(generator), torch.randn(1, 16, 1, 8, 8, generator=generator)]

    def comfy_kwargs(self, extra, i):
        (reference,) = extra
        return {"ref_latents": [reference[i:i + 1].to(self.dtype)]}


class QwenPlusInput(QwenInput):
    def run(self, latents, noise, t, context, text_lengths, references):
        return super().run(latents, noise, t, context, text_lengths, *references.unbind(1))


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Qwen-Image-Edit-2509: up to three control images a sample (one folder each in control_path), each a
    reference latent (RoPE index 1, 2, 3) and each read by the text encoder ("Picture k: " before the caption)."""
    dp_diffusers_folder = True
    dp_folder_pipeline = "QwenImage"
    arch = "qwen_image_edit_plus"
    spec = QWEN_IMAGE_EDIT_PLUS_SPEC
    conditioning_fields = ("references",)
    max_controls = PLUS_IMAGES

    def encode_conditioning(self, vae, media, control):
        return {"references": self._encode_one_frame(vae, control)}   # [N, 16, 1, h, w]

    def to_layers(self):
        layers = super().to_layers()
        layers[0] = QwenPlusInput(self.diffusion_model, self.objective(), self.dtype)
        return layers

    def probe_text(self, generator):
        return [*QwenImageAdapter.probe_text(self, generator), torch.randn(1, 2, 16, 1, 8, 8, generator=generator)]

    def comfy_kwargs(self, extra, i):
        (references,) = extra
        return {"ref_latents": [r.to(self.dtype) for r in references[i:i + 1].unbind(1)]}
