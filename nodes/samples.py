# SPDX-License-Identifier: GPL-3.0-or-later
"""Samples: prompts rendered with ComfyUI's own sampler and every saved epoch LoRA ([samples]); Epoch Samples:
the node the launcher queues to render one epoch's samples in ComfyUI (``launcher/samples.py``)."""
from __future__ import annotations

from pathlib import Path

from comfy_api.latest import io, ui

from ..backend.config.patch import RunPatch
from ..launcher.forms import input_image, unset_if_zero
from . import types as t
from .declared import CheckedNode
from .widgets import start, words

RENDER_ON = {"host ComfyUI": "host", "training run": "run"}
RENDER_NAMES = {v: k for k, v in RENDER_ON.items()}


def parse_strengths(text: str) -> tuple[float, ...]:
    """LoRA strengths, comma separated (e.g. "0.6, 0.8, 1.0")."""
    try:
        values = tuple(float(v) for v in words(text))
    except ValueError:
        raise ValueError(f"strengths {text!r}: write numbers separated by commas, e.g. 0.6, 0.8, 1.0") from None
    return values or (1.0,)


def input_image_path(name: str, widget: str, video: bool = False, whole: bool = True) -> Path:
    """The Samples node's start or end image (``widget``; ``video``: a video or an image, the control video), a
    file under ComfyUI's input directory, as an absolute path (``whole``: see ``input_image``)."""
    import folder_paths
    return input_image(folder_paths.get_input_directory(), name, widget, video, whole)


def _image_file(name: str | None, widget: str, video: bool = False, whole: bool = True) -> str | None:
    """The absolute path of an image (``video``: or video) widget's file, or None where the widget is empty."""
    return str(input_image_path(name, widget, video, whole)) if name and name.strip() else None


def parse_prompts(text: str) -> tuple[str, ...]:
    """One prompt a line; blank lines are skipped."""
    prompts = tuple(line.strip() for line in (text or "").splitlines() if line.strip())
    if not prompts:
        raise ValueError("write at least one prompt (one a line)")
    return prompts


class SamplesNode(CheckedNode):
    # the widgets shown; the rest folded as advanced
    SHOWN = ("prompts", "negative_prompt", "seed", "width", "height", "steps", "cfg", "strengths", "render_on")

    @classmethod
    def define_schema(cls):
        import comfy.samplers
        return io.Schema(
            node_id="PipeTrainSamples", display_name="PipeTrain Samples", category=t.CATEGORY,
            description="Sample images rendered after every saved epoch with the fresh LoRA (ComfyUI's sampler); "
                        "they land beside the LoRA and show in the panel and TensorBoard.",
            inputs=[
                io.String.Input("prompts", default="", multiline=True, tooltip="One prompt a line"),
                io.String.Input("negative_prompt", default=start("samples.negative_prompt"), multiline=True,
                                tooltip="Negative prompt (used "
                                "when cfg > 1)"),
                # no "control after generate" widget: the frontend's would re-randomise the seed at every queue,
                # and two runs' grids compare only at one seed
                io.Int.Input("seed", default=start("samples.seed"), min=0, max=2**63 - 1, control_after_generate=False,
                             tooltip="Noise seed (the same for every epoch and run until you change it, so the "
                             "images are comparable)"),
                io.Int.Input("width", default=start("samples.width"), min=16, max=8192, step=16, tooltip="Image width"),
                io.Int.Input("height", default=start("samples.height"), min=16, max=8192, step=16,
                             tooltip="Image height"),
                io.Int.Input("steps", default=start("samples.steps"), min=1, max=1000, tooltip="Sampling steps"),
                io.Float.Input("cfg", default=start("samples.cfg"), min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance scale (Flux-dev: 1, with guidance below)"),
                io.Float.Input("guidance", default=start("samples.guidance"), min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Flux-dev's distilled guidance input"),
                io.Combo.Input("sampler", options=comfy.samplers.KSampler.SAMPLERS, default=start("samples.sampler"),
                               tooltip="ComfyUI sampler"),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS,
                               default=start("samples.scheduler"),
                               tooltip="ComfyUI scheduler"),
                io.Combo.Input("render_on", options=list(RENDER_ON), default=RENDER_NAMES[start("samples.render")],
                               optional=True, tooltip="host ComfyUI: this ComfyUI renders them on its queue (sharing "
                               "the GPU with your prompts; the run waits, and renders them itself if ComfyUI does "
                               "not answer within host_timeout_s); training run: the run's rank 0 does"),
                io.String.Input("strengths", default=", ".join(map(str, start("samples.strengths"))), optional=True,
                                tooltip="LoRA strengths to render every prompt at, comma separated (e.g. 0, 0.8, "
                                "1.0; 0 is the base model): the panel shows epoch x strength x prompt, to pick the "
                                "epoch and strength"),
                io.Float.Input("host_timeout_s", default=start("samples.host_timeout_s"), min=1.0, max=86400.0,
                               step=60.0, optional=True, tooltip="render_on host ComfyUI: how long the run waits for "
                               "this ComfyUI's samples before it renders them itself (seconds)"),
                io.Int.Input("frames", default=start("samples.frames"), min=1, max=1024, optional=True,
                             tooltip="Video models: each sample is a clip of this many frames (Wan, HunyuanVideo: "
                             "4k+1; LTX-Video, Cosmos: 8k+1; 17 suits both), an animated WebP. Image models: ignored"),
                io.Float.Input("fps", default=start("samples.fps", off=0), min=0.0, max=240.0, step=1.0,
                               optional=True, tooltip="Video models: the clips' frames per second (0: the model's "
                               "frame rate, e.g. Wan 16, LTX-Video 25)"),
                io.String.Input("start_image", default="", optional=True, tooltip="Image-to-video models: the image "
                                "the clips start from, a file under ComfyUI's input directory (e.g. start.png). "
                                "Empty: the first frame of the dataset's first clip (wan_flf2v: its first and last; "
                                "wan_fun_control: of the clip its sample control belongs to)"),
                io.String.Input("end_image", default="", optional=True, tooltip="First-last-frame models "
                                "(wan_flf2v): the image the clips end on, a file under ComfyUI's input directory. "
                                "Empty: the last frame of the dataset's first clip, or none when start_image is set"),
                io.String.Input("control_video", default="", optional=True, tooltip="Control-video models "
                                "(wan_vace, wan_fun_control): the control video (or image) the clips render with, "
                                "a file under ComfyUI's input directory (e.g. pose.mp4). Empty: the control of the "
                                "dataset's first controlled clip (with its VACE mask)"),
                io.Float.Input("seconds", default=start("samples.seconds"), min=1.0, max=1000.0, step=1.0,
                               optional=True, tooltip="Audio models (ACE-Step): each sample is a song this long "
                               "(EmptyAceStepLatentAudio's seconds), saved as FLAC. Image and video models: ignored"),
                io.String.Input("lyrics", default=start("samples.lyrics"), multiline=True, optional=True,
                                tooltip="Audio models (ACE-Step): the lyrics every sample sings, its prompt being the "
                                "tags (TextEncodeAceStepAudio's lyrics; empty: instrumental)"),
            ],
            outputs=[t.Samples.Output(display_name="samples")],
        )

    @classmethod
    def validate_inputs(cls, prompts=None, strengths=None, start_image=None, end_image=None, control_video=None):
        try:
            if prompts is not None:
                parse_prompts(prompts)
            if strengths is not None:
                parse_strengths(strengths)
            # on ComfyUI's event loop: each file's header alone; read whole when the node runs (``input_image``)
            _image_file(start_image, "start_image", whole=False)
            _image_file(end_image, "end_image", whole=False)
            _image_file(control_video, "control_video", video=True, whole=False)
        except ValueError as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, prompts, render_on=None, strengths=None, fps=None, start_image=None, end_image=None,
                control_video=None, **keys) -> io.NodeOutput:
        # negative_prompt, seed, width, height, steps, cfg, guidance, sampler, scheduler, host_timeout_s, frames,
        # seconds, lyrics: as named
        render = RENDER_ON[render_on] if render_on is not None else None
        return io.NodeOutput(RunPatch.of({**keys, "prompts": parse_prompts(prompts), "render": render,
                                          "strengths": parse_strengths(strengths) if strengths is not None else None,
                                          "fps": unset_if_zero(fps),
                                          "start_image": _image_file(start_image, "start_image"),
                                          "end_image": _image_file(end_image, "end_image"),
                                          "control_video": _image_file(control_video, "control_video", video=True)},
                                         "samples"))


class EpochSamplesNode(CheckedNode):
    """Queued by the launcher when a run asks for its epoch samples; renders them here and shows them."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainEpochSamples", display_name="PipeTrain Epoch Samples", category=t.CATEGORY,
            is_output_node=True,
            # internal (PipeTrain queues it): the frontend hides "deprecated" nodes from its library and search,
            # and still runs them
            is_deprecated=True,
            description="Renders a run's [samples] prompts with one epoch LoRA through ComfyUI's sampler (queued "
                        "by PipeTrain for runs whose Samples node renders on this ComfyUI); the PNGs (video models: "
                        "WebP clips) land beside the LoRA and the run announces them.",
            inputs=[
                io.String.Input("run_id", default="", tooltip="Run id (folder under output/pipetrain)"),
                io.String.Input("request", default="", tooltip="The sample request: the epoch LoRA's name "
                                "without .safetensors (<run dir>/sample_requests/<request>.json)"),
            ],
            outputs=[io.Image.Output(display_name="images")],
        )

    @classmethod
    def execute(cls, run_id, request) -> io.NodeOutput:
        from ..launcher.comfy import get_launcher
        from ..launcher.samples import fulfil_request

        _, images, songs = fulfil_request(get_launcher().dirs, run_id, request)
        shown = ui.PreviewAudio(songs, cls=cls) if songs is not None else ui.PreviewImage(images, cls=cls)
        return io.NodeOutput(images, ui=shown)
