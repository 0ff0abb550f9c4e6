"""Z-Image and Lumina 2 end to end on the CPU: generated dataset -> cache (Qwen3-4B / Gemma-2-2B, Flux VAE) ->
2 epochs with 2 DeepSpeed ranks as a 2-stage pipeline, micro-batches of 2 whose captions differ in length ->
epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
from conftest import check_epoch_loras, train

pytestmark = pytest.mark.slow

LONG_CAPTION = ("a red circle on a white background, drawn flat with a soft edge, centred in the frame, "
                "photographed in even daylight with no shadow and nothing else in the picture at all")


@pytest.mark.parametrize("arch", ["z_image", "lumina2"])
def test_two_stage_pipeline_to_comfyui_lora(model_files, make_run, arch):
    # 4 pictures: a micro-batch of 2 in each bucket shape (img00, the long caption, beside img02), 2 steps an epoch
    # (what is asserted of each epoch's LoRA does not grow with the number of steps)
    config = make_run(model_files(arch), images=4, stages=2, epochs=2, micro_batch_size_per_gpu=2,
                      model={"type": arch})
    # Z-Image pads captions to 32 tokens: this one's micro-batch mixes a 64-token caption sequence with a
    # 32-token one (masked padding); Lumina 2's captions differ in length anyway
    (config.parent / "dataset" / "img00.txt").write_text(LONG_CAPTION)
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    engine = run.events("engine")[0]
    # input, 2 context + 2 noise refiners, join | 2 layers, output
    assert engine["stage_bounds"] == [0, 6, 9] and engine["steps_per_epoch"] == 2
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    # 6 linears in each main layer and noise refiner, 5 in each context refiner
    check_epoch_loras(run, config, keys=34)
