"""SDXL through ComfyUI's ``comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel``.

The pipeline layers run ComfyUI's own blocks through its own ``forward_timestep_embed``; what is re-stated
is only ``UNetModel._forward``'s loop, cut into layers:

    SDXLInput        x_t, emb = time_embed(t) + label_emb(y)  ->  (emb, context, x_t)
    InputBlock  x9   input_blocks[i]   reads the top of the stack, pushes its output (a skip connection);
                     input_blocks[0] replaces x_t instead
    MiddleBlock      middle_block      pushes h on top of the 9 skips
    OutputBlock x9   output_blocks[i]  pops h and one skip, pushes the new h
    SDXLOutput       out(h)

Every tuple between layers is ``(emb, context, *stack)``: ``emb`` and ``context`` come from frozen weights
or the data and travel bit-cast to integers (``hide``); every stack entry is a float activation that gets a
gradient (skips carry gradient back to the input blocks). The tuple grows to 12 tensors in the middle and
shrinks again, which DeepSpeed's pipeline passes with ``dynamic_shape=True``.

Nothing in ComfyUI's SDXL path modifies an autograd input in place (``ResBlock`` without scale-shift norm,
``BasicTransformerBlock`` without ``ff_in``, ``SpatialTransformer`` all add out of place), so no block maths is
re-stated. Attention is routed to ComfyUI's ``attention_pytorch`` (torch SDPA) through its
``optimized_attention_override`` seam: the backend ComfyUI picks (sub-quadratic on the CPU, sage/xformers/
flash when installed) is made for inference. The ADM vector ``y`` is built by ComfyUI's
``model_base.SDXL.encode_adm`` with its sampler's defaults (original = target = the latent's pixel size,
crop 0,0), in the first layer, where the bucket size is known from the latent.

LoRA goes on the linears of the SpatialTransformers (``proj_in``, ``proj_out``, ``attn1``/``attn2``
``to_q/k/v/out.0``, ``ff.net.0.proj``, ``ff.net.2``) -- the targets of kohya's SDXL LoRA
("Transformer2DModel"); ResBlocks (time-embedding linears, convolutions) stay untouched. SDXL's
transformer positions are fixed by its published layout (ComfyUI detects only that layout), so they are
module-path prefixes, checked against the loaded model.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ..errors import ModelError
from ..host.patches_comfyui import rebind_forwards
from .checkpointing import CheckpointedLayer, run_checkpointed
from .compiling import compile_module_forwards
from .attention import sdpa_transformer_options
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, with_grad
from .objectives import DiscreteDiffusion
from .spec import ArchSpec, comfy_diffusion_model

# The SpatialTransformer of every SDXL UNet block that has one: input levels 1-2, middle, output levels 2-1.
SDXL_TRANSFORMERS = (
    "input_blocks.4.1", "input_blocks.5.1", "input_blocks.7.1", "input_blocks.8.1", "middle_block.1",
    *(f"output_blocks.{i}.1" for i in range(6)),
)
# The SDXL base UNet exactly as comfy.model_detection derives it from the published weights.
SDXL_UNET_FULL = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
    "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
    "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
    "context_dim": 2048, "num_head_channels": 64,
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
# Same structure (3 levels, linear transformers, context 2048, adm 2816), small widths and depths; ComfyUI
# matches only the published config, so tiny files carry this one in their metadata.
SDXL_UNET_TINY = {
    **SDXL_UNET_FULL, "model_channels": 32, "num_head_channels": 16, "num_heads": -1,
    "transformer_depth": [0, 0, 1, 1, 1, 1], "transformer_depth_middle": 1,
    "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1],
}


def sdxl_unet_config(size: str) -> dict:
    return dict(SDXL_UNET_TINY if size in ("micro", "tiny") else SDXL_UNET_FULL)


def build_sdxl_unet(config: dict | str) -> nn.Module:
    """ComfyUI's SDXL ``UNetModel`` on the meta device, from a config or a size name."""
    config = sdxl_unet_config(config) if isinstance(config, str) else config
    return comfy_diffusion_model("comfy.ldm.modules.diffusionmodules.openaimodel:UNetModel")(config)




SDXL_SPEC = ArchSpec(
    title="SDXL", comfy_configs=("SDXL",), unet_config=sdxl_unet_config, build=build_sdxl_unet,
    detected_sizes=("full",), text_encoders=("clip_l", "clip_g"), clip_type="STABLE_DIFFUSION",
    vae="kl4", example_file="an SDXL UNet or checkpoint", text_encoder_types=("sdxl", "stable_diffusion"))

VAE_SCALE = 8                  # pixels per latent position (ComfyUI's sampler hard-codes it for width/height)
REFERENCE_LATENT = (128, 128)  # layer costs are estimated at SDXL's native 1024x1024 ...
REFERENCE_TEXT_TOKENS = 77     # ... with one 77-token caption chunk


def transformer_paths(dm: nn.Module) -> list[str]:
    """Module paths of the UNet's SpatialTransformers."""
    from comfy.ldm.modules.attention import SpatialTransformer
    return [name for name, m in dm.named_modules() if isinstance(m, SpatialTransformer)]


def comfy_adm(encode_adm, pooled: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """ComfyUI's ``encode_adm`` with the defaults ``comfy.samplers.encode_model_conds`` gives it: width and
    height from the latent, target size = size, crop 0,0. Returns y [B, 2816] on the latent's device."""
    height, width = latent.shape[-2] * VAE_SCALE, latent.shape[-1] * VAE_SCALE
    return encode_adm(pooled_output=pooled, width=width, height=height).to(latent.device)


class SizeConditioning:
    """``comfy_adm`` for training steps: ``[pooled, size embedding]``, the size embedding (the part of ``y`` after
    the pooled vector, which depends only on the latent's size) made by ComfyUI's ``encode_adm`` once per bucket and
    kept on the device. ``encode_adm`` embeds the sizes on the host and moves the pooled vector there, a round trip
    that made every step wait for the GPU to finish the step before it."""

    def __init__(self, encode_adm):
        self._encode_adm = encode_adm
        self._sizes: dict[tuple, torch.Tensor] = {}

    def __call__(self, pooled: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        key = (*latent.shape[-2:], pooled.shape[-1], latent.device)
        sizes = self._sizes.get(key)
        if sizes is None:
            y = comfy_adm(self._encode_adm, torch.zeros(1, pooled.shape[-1]), latent)
            sizes = self._sizes[key] = y[:, pooled.shape[-1]:]
        return torch.cat([pooled, sizes.expand(pooled.shape[0], -1)], dim=1)


def block_tflop(block: nn.Module, pixels: int, text_tokens: int = REFERENCE_TEXT_TOKENS) -> float:
    """Forward TFLOP of one UNet block (a sequence of ResBlock / SpatialTransformer / Up/Downsample) run on
    ``pixels`` latent positions: 2 x (conv and linear multiply-adds + attention matmuls)."""
    from comfy.ldm.modules.attention import CrossAttention
    from comfy.ldm.modules.diffusionmodules.openaimodel import Downsample, Upsample

    macs = 0
    for layer in block:
        if isinstance(layer, Upsample):
            pixels *= 4  # its convolution runs at the upsampled size
        out_pixels = pixels // 4 if isinstance(layer, Downsample) else pixels
        for name, m in layer.named_modules():
            if isinstance(m, nn.Conv2d):
                macs += m.weight.numel() * out_pixels
            elif isinstance(m, nn.Linear):
                rows = 1 if "emb_layers" in name else text_tokens if re.search(r"attn2\.to_[kv]$", name) else pixels
                macs += m.weight.numel() * rows
            elif isinstance(m, CrossAttention):
                keys = text_tokens if name.endswith("attn2") else pixels
                macs += 2 * pixels * keys * m.heads * m.dim_head
        pixels = out_pixels
    return 2 * macs / 1e12


def _resolution_factor(block: nn.Module) -> float:
    from comfy.ldm.modules.diffusionmodules.openaimodel import Downsample, Upsample
    factor = 1.0
    for layer in block:
        factor *= 0.25 if isinstance(layer, Downsample) else 4.0 if isinstance(layer, Upsample) else 1.0
    return factor


def _is_channels_last(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _in_layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _like(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` in ``x``'s memory format, copied only if it is not (CUDA's GroupNorm returns NCHW whatever it is
    given)."""
    return _in_layout(out, _is_channels_last(x))


class _GradientInInputLayout(torch.autograd.Function):
    """Identity whose backward hands the gradient on in the forward input's memory format. CUDA's GroupNorm backward
    returns an NCHW gradient, compiled norms keep that stride, and the convolution before the norm then copied it
    back to channels-last (cuDNN wants its output gradient in its input's layout) in every backward: compiled, the
    conversion is written by the norm backward's own kernel."""

    @staticmethod
    def forward(ctx, x):
        ctx.channels_last = _is_channels_last(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _in_layout(grad, ctx.channels_last)


def group_norm(norm, x):
    return _like(x, norm(_GradientInInputLayout.apply(x)))


def group_norm_act(norm, act, x, shift=None):
    """``act(norm(x + shift))``: the pair every ResBlock runs twice, the second time after adding its time
    embedding."""
    channels_last = _is_channels_last(x)    # taken before the add: a compiled add may pick NCHW for its output
    x = _GradientInInputLayout.apply(x)
    if shift is not None:
        x = x + shift
    return _in_layout(act(norm(x)), channels_last)


class Norms:
    """The GroupNorm calls of the re-stated forwards below, shared by every block: eager, or compiled by
    ``SDXLAdapter.compile`` (Inductor fuses the SiLU and the embedding add into the norm's passes and keeps the
    activation channels-last; eager CUDA GroupNorm turns it NCHW, and the convolution after it turns it back)."""

    def __init__(self):
        self.norm, self.norm_act = group_norm, group_norm_act

    def compile(self, dynamic: bool | None) -> None:
        # dynamic from the first call (unless static shapes are asked for): every resolution and batch shares a
        # graph, one per channel count (parameters keep static shapes), where automatic dynamic shapes would first
        # compile the first shapes statically
        dynamic = dynamic is not False
        self.norm = torch.compile(group_norm, dynamic=dynamic)
        self.norm_act = torch.compile(group_norm_act, dynamic=dynamic)


def spatial_transformer_forward(st, norms, x, context=None, transformer_options={}):
    """ComfyUI's ``SpatialTransformer.forward`` (linear projections as SDXL and SD 2.x have them, 1x1 convolutions
    as SD 1.x has), ending in the input's memory format: ComfyUI's ends in ``.contiguous()``, which copies a
    channels-last activation to NCHW for every op after it to convert back. Same maths, same ``transformer_options``
    bookkeeping."""
    if not isinstance(context, list):
        context = [context] * len(st.transformer_blocks)
    b, c, h, w = x.shape
    transformer_options["activations_shape"] = list(x.shape)
    x_in = x
    x = norms.norm(st.norm, x)
    if not st.use_linear:
        x = st.proj_in(x)
    x = x.movedim(1, 3).flatten(1, 2)
    if st.use_linear:
        x = st.proj_in(x)
    for i, block in enumerate(st.transformer_blocks):
        transformer_options["block_index"] = i
        x = block(x, context=context[i], transformer_options=transformer_options)
    if st.use_linear:
        x = st.proj_out(x)
    x = x.reshape(b, h, w, -1).movedim(3, 1)    # channels-last strides: no copy for such an x_in
    if not st.use_linear:
        x = st.proj_out(x)
    return _like(x_in, x) + x_in


def res_block_forward(rb, norms, x, emb):
    """ComfyUI's ``ResBlock._forward`` for the ResBlocks SDXL has (no resampling inside, the time embedding added,
    no scale-shift norm), with its GroupNorm + SiLU pairs through ``norms``."""
    h = rb.in_layers[2](norms.norm_act(rb.in_layers[0], rb.in_layers[1], x))
    emb_out = rb.emb_layers(emb).type(h.dtype)[..., None, None]
    h = norms.norm_act(rb.out_layers[0], rb.out_layers[1], h, emb_out)
    h = rb.out_layers[3](rb.out_layers[2](h))
    return rb.skip_connection(x) + h


def _restates(m: nn.Module) -> bool:
    from comfy.ldm.modules.attention import SpatialTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

    if type(m) is SpatialTransformer:
        return True
    return (type(m) is ResBlock and not (m.updown or m.skip_t_emb or m.use_scale_shift_norm or m.exchange_temb_dims
                                         or m.use_checkpoint) and len(m.in_layers) == 3 and len(m.out_layers) == 4)


def restate_blocks(dm: nn.Module, norms: Norms) -> int:
    """Route SDXL's SpatialTransformers and ResBlocks through the forwards above; returns how many."""
    from comfy.ldm.modules.attention import SpatialTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

    forwards = {SpatialTransformer: spatial_transformer_forward, ResBlock: res_block_forward}
    return rebind_forwards([m for m in dm.modules() if _restates(m)], forwards, norms)


class UNetInput(TupleLayer):
    """x_t and the time embedding ``time_embed(t)``: the first layer of a UNet without class or ADM embedding
    (SD 1.x / 2.x)  ->  (emb, context, x_t)."""
    cost = 1e-3

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the embedders become children: the blocks belong to other layers
        self.time_embed = dm.time_embed
        self.model_channels = dm.model_channels
        self.objective, self.dtype = objective, dtype

    def noisy_and_emb(self, latents, noise, t):
        from comfy.ldm.modules.diffusionmodules.util import timestep_embedding

        x = self.objective.noisy(latents, noise, t).to(self.dtype).contiguous(memory_format=torch.channels_last)
        t_emb = timestep_embedding(self.objective.model_timestep(t), self.model_channels, repeat_only=False)
        return x, self.time_embed(t_emb.to(self.dtype))

    def run(self, latents, noise, t, context):
        x, emb = self.noisy_and_emb(latents, noise, t)
        return hide(emb), hide(context.to(self.dtype)), with_grad(x)


class SDXLInput(UNetInput):
    """``UNetInput`` plus SDXL's ADM vector: emb = time_embed(t) + label_emb(y)."""

    def __init__(self, dm, encode_adm, objective, dtype):
        super().__init__(dm, objective, dtype)
        self.label_emb = dm.label_emb
        self.size_conditioning = SizeConditioning(encode_adm)  # through ComfyUI's model_base.SDXL.encode_adm

    def run(self, latents, noise, t, context, pooled):
        x, emb = self.noisy_and_emb(latents, noise, t)
        emb = emb + self.label_emb(self.size_conditioning(pooled, x).to(self.dtype))
        return hide(emb), hide(context.to(self.dtype)), with_grad(x)


class _Block(CheckpointedLayer):
    """One of ComfyUI's ``TimestepEmbedSequential`` blocks, run by ComfyUI's ``forward_timestep_embed``."""

    def __init__(self, block, dtype, cost: float):
        super().__init__()
        self.block, self.dtype, self.cost = block, dtype, cost

    def block_forward(self, h, emb, context, output_shape):
        from comfy.ldm.modules.diffusionmodules.openaimodel import forward_timestep_embed

        return forward_timestep_embed(self.block, h, reveal(emb, self.dtype), reveal(context, self.dtype),
                                      sdpa_transformer_options(), output_shape)

    def run_block(self, h, emb, context, output_shape=None):
        if self.checkpoint_activations and torch.is_grad_enabled():
            return run_checkpointed(self.checkpoint_activations, self.block_forward, h, emb, context,
                                    output_shape)
        return self.block_forward(h, emb, context, output_shape)


class InputBlock(_Block):
    """``input_blocks[i]`` on the top of the stack; its output is pushed as a skip connection
    (``input_blocks[0]`` replaces the noisy latent, which is no skip)."""

    def __init__(self, block, dtype, cost, replace_top: bool = False):
        super().__init__(block, dtype, cost)
        self.replace_top = replace_top

    def run(self, emb, context, *stack):
        h = self.run_block(stack[-1], emb, context)
        kept = stack[:-1] if self.replace_top else stack
        return (emb, context, *kept, h)


class MiddleBlock(InputBlock):
    """``middle_block`` on the last skip; its output h goes on top of the skips."""


class OutputBlock(_Block):
    """``output_blocks[i]``: pops h and the newest skip, runs the block on their concatenation, pushes h.
    Upsampling is told the next skip's shape, as in ComfyUI (odd latent sizes)."""

    def run(self, emb, context, *stack):
        *skips, skip, h = stack
        output_shape = skips[-1].shape if skips else None
        h = self.run_block(torch.cat([h, skip], dim=1), emb, context, output_shape)
        return (emb, context, *skips, h)


class SDXLOutput(TupleLayer):
    """``out(h)``: GroupNorm, SiLU, convolution, the norm pair through ``norms`` as in the ResBlocks."""

    def __init__(self, dm, dtype, cost, norms: Norms):
        super().__init__()
        self.out, self.dtype, self.cost, self.norms = dm.out, dtype, cost, norms

    def run(self, emb, context, h):
        h = h.type(self.dtype)
        norm, act, conv = self.out
        out = conv(self.norms.norm_act(norm, act, h))
        return out.to(torch.promote_types(out.dtype, torch.float32))


class SDXLAdapter(ModelAdapter):
    dp_diffusers_folder = True
    arch = "sdxl"
    unet = True
    dp_text_encoder_lora = True
    spec = SDXL_SPEC
    latent_format = "SDXL"
    lora_block_prefixes = SDXL_TRANSFORMERS
    text_fields = ("cond", "pooled")
    spatial_multiple = 32  # latent sides divisible by 4: the UNet's two downsamplings stay exact
    # NHWC: cuDNN's bf16 convolutions need no layout transposes and the SpatialTransformers' b c h w -> b (h w) c
    # is a view (+8% samples/s at batch 8 on an H200). SDXLInput makes the latent NHWC; a stage boundary sends
    # plain contiguous tensors (train.pipeline.sendable).
    memory_format = torch.channels_last
    compiles_checkpoints = False   # compile() compiles the transformer blocks inside the checkpointed UNet blocks
    timestep_range = False         # DDPM's integer timesteps: min_t / max_t are the flow models'
    snr_weighting = True           # min_snr_gamma, debiased_estimation_loss

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.norms = Norms()

    reference_latent = REFERENCE_LATENT   # the latent size layer costs are estimated at

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        out = clip.encode_from_tokens(tokens, return_pooled=True, return_dict=True)
        encoded = {"cond": out["cond"][0], "pooled": out["pooled_output"][0]}
        return {name: encoded[name].float().cpu() for name in self.text_fields}

    def collate_text(self, items):
        """Captions of different chunk counts (77, 154, ... tokens) are batched the way ComfyUI batches
        them (``CONDCrossAttn.concat``: repeated to a common length, which leaves attention unchanged)."""
        from comfy.conds import CONDCrossAttn

        conds = [CONDCrossAttn(it["cond"][None]) for it in items]
        return [conds[0].concat(conds[1:]), *(torch.stack([it[name] for it in items])
                                               for name in self.text_fields[1:])]

    def load_diffusion_model(self):
        patcher = super().load_diffusion_model()
        self.check_model()
        return patcher

    def check_model(self) -> None:
        if self.diffusion_model.in_channels != 4:   # inpainting UNets take the mask and masked image as well
            raise ModelError(f"{self.cfg.diffusion_model}: a UNet with {self.diffusion_model.in_channels} input "
                             f"channels (an inpainting model); {self.spec.title} training takes the 4-channel "
                             "text-to-image UNet")
        found = transformer_paths(self.diffusion_model)
        if sorted(found) != sorted(self.lora_block_prefixes):
            raise ModelError(f"{self.cfg.diffusion_model}: not the {self.spec.title} UNet layout (SpatialTransformers "
                             f"at {found}, expected {list(self.lora_block_prefixes)})")
        self.objective()  # rejects sampling types this adapter does not train

    def objective(self):
        import comfy.model_sampling as cms

        v_pred = self.cfg.v_pred
        weighting = dict(min_snr_gamma=self.cfg.min_snr_gamma, debiased=self.cfg.debiased_estimation_loss)
        if self.patcher is None:  # not loaded (yet): ComfyUI's default SDXL schedule
            return DiscreteDiffusion(cms.ModelSamplingDiscrete(), "v" if v_pred else "eps", **weighting)
        ms = self.model_sampling
        if not isinstance(ms, cms.ModelSamplingDiscrete) or not isinstance(ms, cms.EPS) or isinstance(ms, cms.EDM):
            kind = " + ".join(b.__name__ for b in type(ms).__bases__)
            raise ModelError(f"{self.cfg.diffusion_model}: ComfyUI samples this model with {kind}; "
                             f"{self.spec.title} training supports ModelSamplingDiscrete with EPS or V_PREDICTION only")
        v_pred = v_pred or isinstance(ms, cms.V_PREDICTION)  # a v-pred checkpoint samples as v in ComfyUI
        return DiscreteDiffusion(ms, "v" if v_pred else "eps", **weighting)

    def to_layers(self):
        dm = self.diffusion_model
        restate_blocks(dm, self.norms)
        pixels = self.reference_latent[0] * self.reference_latent[1]
        layers: list[nn.Module] = [self.input_layer(dm)]
        for i, block in enumerate(dm.input_blocks):
            layers.append(InputBlock(block, self.dtype, block_tflop(block, pixels),
                                     replace_top=i == 0))
            pixels = int(pixels * _resolution_factor(block))
        layers.append(MiddleBlock(dm.middle_block, self.dtype, block_tflop(dm.middle_block, pixels)))
        for block in dm.output_blocks:
            layers.append(OutputBlock(block, self.dtype, block_tflop(block, pixels)))
            pixels = int(pixels * _resolution_factor(block))
        layers.append(SDXLOutput(dm, self.dtype, block_tflop(dm.out, pixels), self.norms))
        return layers

    def input_layer(self, dm) -> TupleLayer:
        return SDXLInput(dm, self.patcher.model.encode_adm, self.objective(), self.dtype)

    def compile(self, layers, checkpoint_inside=True, memory_budget=None, cuda_graphs=False):
        """The ``BasicTransformerBlock``s inside the UNet blocks are compiled, with dynamic shapes, and so are the
        GroupNorms (with the SiLU and embedding add around them, ``Norms``); convolutions, resampling and the
        projections stay eager (cuDNN, cuBLAS), and so does the layer's checkpoint around them
        (``checkpoint_inside`` has nothing to act on). Compiling whole UNet blocks failed both ways: with dynamic
        shapes Inductor (torch 2.14) cannot order the symbolic conv strides ("cannot determine truth value of
        Relational"), and statically every block shape and bucket is its own graph (~15 with backward, over 10
        minutes on an H200). The transformer blocks of one width share one graph for every block and bucket.
        ComfyUI's forward is compiled as it is: its ``transformer_options`` hold only the SDPA override here (no
        patches), and nothing in it adds in place. Returns how many transformer blocks were compiled.

        Where the run allows it (``cuda_graphs``), the transformer blocks replay as CUDA graphs: at batch 8 on an
        H200 the host took longer to launch their kernels than the GPU to run them (17.6 -> 18.8 samples/s)."""
        from comfy.ldm.modules.attention import BasicTransformerBlock
        self.norms.compile(self.compile_dynamic)
        blocks = [m for layer in layers for m in layer.modules() if isinstance(m, BasicTransformerBlock)]
        return compile_module_forwards(blocks, dynamic=self.compile_dynamic, memory_budget=memory_budget,
                                       cuda_graphs=cuda_graphs)

    def probe_text(self, generator):
        dm = self.diffusion_model
        context_dim = dm.middle_block[1].transformer_blocks[0].attn2.to_k.in_features
        pooled_dim = dm.label_emb[0][0].in_features - 6 * self.patcher.model.embedder.dim
        return [torch.randn(1, REFERENCE_TEXT_TOKENS, context_dim, generator=generator),
                torch.randn(1, pooled_dim, generator=generator)]

    def reference_forward(self, x_t, t, text):
        cond, pooled = text
        y = comfy_adm(self.patcher.model.encode_adm, pooled, x_t)
        return self.diffusion_model(x_t.to(self.dtype), t, context=cond.to(self.dtype), y=y.to(self.dtype))
