# SPDX-License-Identifier: GPL-3.0-or-later
"""Loss and timestep options: ``loss_type`` (mse / l1 / huber / smooth_l1, diffusion-pipe's ``huber_delta`` and
``smooth_l1_beta``), ai-toolkit's ``noise_offset``, ``min_t`` / ``max_t`` on every flow model, and SDXL's
``min_snr_gamma`` / ``debiased_estimation_loss`` weights against a hand computation from the SDXL schedule."""
import pytest
import torch
import torch.nn.functional as F
from feed_stubs import FlowAdapter, Store, cache_entries

from pipetrain.backend.config import ModelConfig, RunConfig
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.models.losses import Loss
from pipetrain.backend.host.runtime import ensure_comfyui
from pipetrain.backend.config.schema import from_dict


@pytest.fixture(scope="module", autouse=True)
def comfyui():
    ensure_comfyui()


def _run(model: dict | None = None, **keys) -> RunConfig:
    return from_dict(RunConfig, {"output_dir": "o", "dataset": "d.toml",
                                 "model": {"type": "flux", "diffusion_model": "m", "vae": "v", **(model or {})},
                                 **keys})


def _tensors(shape=(3, 4, 8, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * 2 for _ in range(3)]


# --- loss_type ----------------------------------------------------------------------------------------------
def test_each_loss_type_is_torchs_loss_on_fixed_tensors():
    pred, target, _ = _tensors()
    expected = {"mse": F.mse_loss(pred, target), "l1": F.l1_loss(pred, target),
                "huber": F.huber_loss(pred, target, delta=0.3), "smooth_l1": F.smooth_l1_loss(pred, target, beta=0.2)}
    got = {kind: Loss(kind, huber_delta=0.3, smooth_l1_beta=0.2)(pred, target) for kind in expected}
    for kind in expected:
        assert torch.equal(got[kind], expected[kind]), kind
    assert len({round(float(v), 4) for v in got.values()}) == 4          # four different values: none ignored
    # the parameter matters: huber at delta 0.3 is not huber at 1.0 (torch's default)
    assert not torch.allclose(Loss("huber", huber_delta=0.3)(pred, target), F.huber_loss(pred, target))
    # bfloat16 predictions are compared in float32, as the MSE always was
    assert torch.equal(Loss("l1")(pred.bfloat16(), target), F.l1_loss(pred.bfloat16().float(), target))
    # per-sample weights scale each sample's mean before the batch mean
    w = torch.tensor([0.5, 1.0, 2.0])
    per_sample = F.huber_loss(pred, target, delta=0.3, reduction="none").mean((1, 2, 3))
    assert torch.allclose(Loss("huber", huber_delta=0.3)(pred, target, w), (w * per_sample).mean())


def test_the_configured_loss_is_the_one_the_adapter_computes():
    from pipetrain.backend.models.flux import FluxAdapter

    pred, x0, noise = _tensors()
    t = torch.tensor([0.2, 0.5, 0.9])
    cases = [(_run(), F.mse_loss(pred, noise - x0)),
             (_run(huber_delta=0.3), F.huber_loss(pred, noise - x0, delta=0.3)),         # diffusion-pipe's rule
             (_run(smooth_l1_beta=0.2), F.smooth_l1_loss(pred, noise - x0, beta=0.2)),
             (_run(loss_type="l1"), F.l1_loss(pred, noise - x0)),
             (_run(loss_type="huber"), F.huber_loss(pred, noise - x0, delta=1.0))]
    for cfg, expected in cases:
        adapter = FluxAdapter(cfg.model)
        adapter.use_loss(Loss.from_config(cfg))
        assert torch.equal(adapter.loss(pred, (x0, noise, t)), expected), cfg.loss_kind
    # the default is the MSE the adapters computed before (bit-equal), also without use_loss
    assert torch.equal(FluxAdapter(_run().model).loss(pred, (x0, noise, t)), F.mse_loss(pred, noise - x0))
    assert Loss.from_config(_run()) == Loss("mse")
    # the engine hands it to the adapter: tests/ranks/test_train_loss.py checks a run's reported loss


@pytest.mark.parametrize("keys, key, fragment", [
    ({"loss_type": "mse", "huber_delta": 0.5}, "huber_delta", "loss_type = 'huber'"),
    ({"loss_type": "huber", "smooth_l1_beta": 0.5}, "smooth_l1_beta", "loss_type = 'smooth_l1'"),
    ({"huber_delta": 0.5, "smooth_l1_beta": 0.5}, "smooth_l1_beta", "not both"),
    ({"huber_delta": 0.0}, "huber_delta", "must be > 0"),
    ({"loss_type": "smooth_l1", "smooth_l1_beta": -1.0}, "smooth_l1_beta", "must be > 0"),
    ({"loss_type": "wavelet"}, "loss_type", "huber"),
    ({"noise_offset": -0.1}, "noise_offset", "[0, 1]"),
    ({"noise_offset": 2.0}, "noise_offset", "[0, 1]"),
])
def test_loss_keys_are_validated_naming_the_key(keys, key, fragment):
    with pytest.raises(ConfigError) as err:
        _run(**keys)
    assert f"key '{key}'" in str(err.value) and fragment in str(err.value), str(err.value)


def test_a_diffusion_pipe_config_with_huber_delta_loads_and_round_trips(tmp_path):
    from pipetrain.backend.config import load_run_config, save_toml

    (tmp_path / "dataset.toml").write_text("resolutions = [512]\n[[directory]]\npath = 'images'\n")
    (tmp_path / "run.toml").write_text("output_dir = 'out'\ndataset = 'dataset.toml'\nhuber_delta = 0.25\n"
                                       "pseudo_huber_c = 0.5\n[model]\ntype = 'sdxl'\ndiffusion_model = 'm'\n"
                                       "vae = 'v'\ndtype = 'bfloat16'\nmin_snr_gamma = 5\n"
                                       "debiased_estimation_loss = true\n")
    cfg = load_run_config(tmp_path / "run.toml")
    assert (cfg.loss_kind, cfg.huber_delta, cfg.model.min_snr_gamma, cfg.model.debiased_estimation_loss) == (
        "huber", 0.25, 5, True)
    save_toml(cfg, tmp_path / "copy.toml")
    again = load_run_config(tmp_path / "copy.toml")
    assert (again.loss_kind, again.huber_delta, again.model) == ("huber", 0.25, cfg.model)


# --- noise_offset -------------------------------------------------------------------------------------------
def test_noise_offset_shifts_each_sample_channel_and_zero_keeps_the_noise_bit_equal():
    from pipetrain.backend.train.feed import MicroBatchFeed, sample_seed

    entries = cache_entries(64)

    def build(**kw):
        (_, noise, t, _), _ = MicroBatchFeed(FlowAdapter(), Store(), seed=3, dp_rank=0, dp_world=1, **kw).build(
            entries, epoch=1, step=2, micro=0)
        return noise, t

    plain, zero, offset = build(), build(noise_offset=0.0), build(noise_offset=0.1)
    assert torch.equal(plain[0], zero[0]) and torch.equal(plain[1], zero[1])
    assert torch.equal(offset[1], plain[1])                       # the timesteps stay those of the plain run
    shift = offset[0] - plain[0]
    # one value per sample and channel, constant over the latent's pixels ...
    assert torch.allclose(shift, shift[..., :1, :1].expand_as(shift), atol=1e-6)
    per_channel = shift[..., 0, 0]
    # ... drawn from the sample's own generator after its noise and timestep (ai-toolkit: offset x N(0, 1))
    g = torch.Generator().manual_seed(sample_seed(3, 1, 2, 5))
    torch.randn(16, 4, 4, generator=g), torch.randn(1, generator=g)
    assert torch.allclose(per_channel[5], 0.1 * torch.randn(16, generator=g), atol=1e-6)
    # 64 x 16 offsets: mean 0, standard deviation the configured 0.1
    assert abs(float(per_channel.mean())) < 0.01 and abs(float(per_channel.std()) - 0.1) < 0.01


def test_noise_offset_reaches_the_training_feed_not_the_eval_feed():
    import inspect

    from pipetrain.backend.train import engine, eval as eval_module
    assert "noise_offset=cfg.noise_offset" in inspect.getsource(engine.build_engine)
    assert "noise_offset" not in inspect.getsource(eval_module.build_eval_sets)   # eval keeps plain noise


# --- min_t / max_t on every flow model ----------------------------------------------------------------------
def _flow_types():
    from pipetrain.backend.models.registry import ADAPTERS, adapter_class, unavailable_reason
    from pipetrain.backend.host.runtime import PINNED_VERSION
    # the types the pinned ComfyUI trains (Flux 2 Klein needs a newer one: check_model refuses it there)
    return [t for t in sorted(ADAPTERS) if adapter_class(t).timestep_range
            and not unavailable_reason(t, PINNED_VERSION)]


def test_every_model_but_sdxl_takes_a_timestep_range():
    assert "sdxl" not in _flow_types() and {"flux", "sd3", "wan", "ltx_video", "qwen_image"} <= set(_flow_types())


@pytest.mark.parametrize("model_type", _flow_types())
def test_min_t_max_t_keep_every_flow_models_timesteps_inside(tmp_path, model_type):
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.preflight import check_model

    cfg = ModelConfig(type=model_type, diffusion_model="d", vae="v", min_t=0.3, max_t=0.6)
    cfg.validate(tmp_path / "run.toml")
    check_model(cfg, tmp_path / "run.toml")
    objective = adapter_class(model_type)(cfg).objective()
    g = torch.Generator().manual_seed(0)
    for seq_len in (64, 4096):
        t = torch.cat([objective.sample_t(1, seq_len, g) for _ in range(300)])
        assert t.min() >= 0.3 and t.max() <= 0.6, model_type
        assert t.min() < 0.33 and t.max() > 0.57, model_type      # the whole range, not one end of it
        assert 0.3 <= float(objective.quantile_t(0.5, seq_len)) <= 0.6
    full = adapter_class(model_type)(ModelConfig(type=model_type, diffusion_model="d", vae="v")).objective()
    wide = torch.cat([full.sample_t(1, 64, g) for _ in range(300)])
    assert wide.min() < 0.3 or wide.max() > 0.6                   # without the keys: outside it too


def test_sdxl_refuses_min_t_and_flow_models_refuse_snr_weighting(tmp_path):
    from pipetrain.backend.preflight import check_model

    for cfg, key in ((ModelConfig(type="sdxl", diffusion_model="d", vae="v", min_t=0.2), "model.min_t"),
                     (ModelConfig(type="flux", diffusion_model="d", vae="v", min_snr_gamma=5.0), "model.min_snr_gamma"),
                     (ModelConfig(type="wan", diffusion_model="d", vae="v", debiased_estimation_loss=True),
                      "model.debiased_estimation_loss")):
        with pytest.raises(ConfigError) as err:
            check_model(cfg, tmp_path / "run.toml")
        assert f"key '{key}'" in str(err.value)
    with pytest.raises(ConfigError, match="must be > 0"):
        ModelConfig(type="sdxl", diffusion_model="d", vae="v", min_snr_gamma=0.0).validate(tmp_path / "run.toml")
    check_model(ModelConfig(type="sdxl", diffusion_model="d", vae="v", min_snr_gamma=5.0,
                            debiased_estimation_loss=True), tmp_path / "run.toml")


# --- SDXL: min_snr_gamma, debiased_estimation_loss ----------------------------------------------------------
def _sdxl_snr() -> torch.Tensor:
    """SDXL's schedule by hand: betas linear in sqrt from 0.00085 to 0.012 over 1000 steps (diffusers'
    'scaled_linear', ComfyUI's 'linear'); SNR = alphas_cumprod / (1 - alphas_cumprod)."""
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    return alphas_cumprod / (1 - alphas_cumprod)


@pytest.mark.parametrize("v_pred", [False, True])
def test_sdxl_snr_weights_match_a_hand_computation_from_alphas_cumprod(v_pred):
    from pipetrain.backend.models.sdxl import SDXLAdapter

    t = torch.tensor([0.0, 1.0, 10.0, 100.0, 250.0, 500.0, 999.0])
    snr = _sdxl_snr()[t.long()]
    assert snr[0] > 1000 and snr[-1] < 5 < snr[3]       # the cap and both sides of gamma are exercised
    min_snr = snr.clamp(max=5.0) / (snr + 1 if v_pred else snr)
    capped = snr.clamp(max=1000.0)
    debiased = 1 / (capped + 1) if v_pred else 1 / capped.sqrt()

    def weights(**keys):
        cfg = ModelConfig(type="sdxl", diffusion_model="d", vae="v", v_pred=v_pred, **keys)
        return SDXLAdapter(cfg).objective().loss_weights(t)

    assert weights() is None
    assert torch.allclose(weights(min_snr_gamma=5.0).double(), min_snr, rtol=1e-5)
    assert torch.allclose(weights(debiased_estimation_loss=True).double(), debiased, rtol=1e-5)
    assert torch.allclose(weights(min_snr_gamma=5.0, debiased_estimation_loss=True).double(), min_snr * debiased,
                          rtol=1e-5)


def test_sdxl_loss_weighs_each_samples_loss():
    from pipetrain.backend.models.sdxl import SDXLAdapter

    pred, x0, noise = _tensors((4, 4, 8, 8), seed=1)
    t = torch.tensor([0.0, 40.0, 500.0, 990.0])
    snr = _sdxl_snr()[t.long()]
    adapter = SDXLAdapter(ModelConfig(type="sdxl", diffusion_model="d", vae="v", min_snr_gamma=5.0))
    per_sample = ((pred - noise) ** 2).mean((1, 2, 3)).double()        # eps prediction: the target is the noise
    expected = (snr.clamp(max=5.0) / snr * per_sample).mean()
    assert torch.allclose(adapter.loss(pred, (x0, noise, t)).double(), expected, rtol=1e-5)
    adapter.use_loss(Loss("l1"))
    per_sample = (pred - noise).abs().mean((1, 2, 3)).double()
    assert torch.allclose(adapter.loss(pred, (x0, noise, t)).double(), (snr.clamp(max=5.0) / snr * per_sample).mean(),
                          rtol=1e-5)
    plain = SDXLAdapter(ModelConfig(type="sdxl", diffusion_model="d", vae="v"))
    assert torch.equal(plain.loss(pred, (x0, noise, t)), F.mse_loss(pred, noise))
