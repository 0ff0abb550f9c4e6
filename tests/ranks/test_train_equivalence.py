"""Exact-value checks of the parallel layout with real gloo ranks on a micro Flux:
2 pipeline stages == 1 stage, accumulation averages (GA 2 x micro 1 == GA 1 x micro 2), and data
parallelism averages too (2 ranks x micro 1 == 1 rank x micro 2)."""
import pytest
import torch
from conftest import train
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

COMMON = dict(epochs=1, max_steps=2, gradient_clipping=0.0, checkpoint_every_n_epochs=None,
              optimizer={"type": "sgd", "lr": 0.5, "weight_decay": 0.0})


def _final_lora(run):
    assert run.returncode == 0, run.output[-4000:]
    return load_file(str(run.loras()[-1]))


def _assert_same(a, b, rtol=1e-4, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=rtol, atol=atol), (k, (a[k] - b[k]).abs().max())


def _square_dataset(make_run, files, name, **kw):
    # one bucket only (resolution 64, no aspect buckets) so any micro-batch size can be formed
    config = make_run(files, images=4, name=name, **COMMON, **kw)
    text = config.with_name("dataset.toml").read_text().replace("enable_ar_bucket = true", "enable_ar_bucket = false")
    config.with_name("dataset.toml").write_text(text)
    return config


def test_two_stages_equal_one_stage(micro_flux_files, make_run):
    one = train(_square_dataset(make_run, micro_flux_files, "one", stages=1), ranks=1)
    two = train(_square_dataset(make_run, micro_flux_files, "two", stages=2), ranks=2)
    lora_one, lora_two = _final_lora(one), _final_lora(two)
    assert one.losses() == pytest.approx(two.losses(), rel=1e-5)
    _assert_same(lora_one, lora_two)
    base = load_file(str(one.loras()[-1]))
    assert any(v.abs().max() > 0 for k, v in base.items() if "lora_B" in k)


def test_accumulation_and_data_parallel_average(micro_flux_files, make_run):
    ga = train(_square_dataset(make_run, micro_flux_files, "ga", stages=1, gradient_accumulation_steps=2), ranks=1)
    mb = train(_square_dataset(make_run, micro_flux_files, "mb", stages=1, micro_batch_size_per_gpu=2), ranks=1)
    dp = train(_square_dataset(make_run, micro_flux_files, "dp", stages=1), ranks=2)
    assert ga.losses() == pytest.approx(mb.losses(), rel=1e-5)
    assert dp.losses() == pytest.approx(mb.losses(), rel=1e-5)
    _assert_same(_final_lora(ga), _final_lora(mb))
    _assert_same(_final_lora(dp), _final_lora(mb))
