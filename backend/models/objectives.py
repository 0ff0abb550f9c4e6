"""Training objectives, each its own object: how a clean latent is noised, what the network should
predict, and which timesteps are drawn. The noise schedules come from ComfyUI's ``model_sampling``."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _expand(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *([1] * (like.ndim - 1))).to(like.dtype)


@dataclass
class FlowMatching:
    """Rectified flow: x_t = (1 - t) x0 + t noise, target noise - x0, t in (0, 1).

    ``sample_method`` logit_normal or uniform; ``shift`` a constant shift (SD3-style, ComfyUI's
    ``time_snr_shift``); ``flux_shift`` the resolution-dependent shift of Flux (ComfyUI's ``flux_time_shift``
    with mu interpolated on the image token count). ``multiplier`` maps t to the timestep the network takes
    (ComfyUI's ``ModelSamplingDiscreteFlow.timestep``: 1000 for SD3 and Wan; Flux takes t itself).
    """
    sample_method: str = "logit_normal"
    sigmoid_scale: float = 1.0
    shift: float | None = None
    flux_shift: bool = False
    multiplier: float = 1.0

    @classmethod
    def from_model_config(cls, c, default_shift: float | None = None, multiplier: float = 1.0) -> "FlowMatching":
        """The objective a ``[model]`` table asks for; ``default_shift`` applies when it sets no ``shift``."""
        return cls(sample_method=c.timestep_sample_method, sigmoid_scale=c.sigmoid_scale,
                   shift=default_shift if c.shift is None else c.shift, flux_shift=c.flux_shift,
                   multiplier=float(multiplier))

    def sample_t(self, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        if self.sample_method == "logit_normal":
            t = torch.sigmoid(torch.randn(batch, generator=generator) * self.sigmoid_scale)
        else:
            t = torch.rand(batch, generator=generator)
        return self._shift(t, seq_len)

    def quantile_t(self, q: float, seq_len: int) -> torch.Tensor:
        """The q-quantile of the timestep distribution ``sample_t`` draws from (eval at fixed timesteps)."""
        q = torch.tensor([q], dtype=torch.float64)
        if self.sample_method == "logit_normal":
            t = torch.sigmoid(torch.special.ndtri(q) * self.sigmoid_scale)
        else:
            t = q
        return self._shift(t.float(), seq_len)

    def _shift(self, t: torch.Tensor, seq_len: int) -> torch.Tensor:
        from comfy.model_sampling import flux_time_shift, time_snr_shift

        if self.flux_shift:
            mu = flux_mu(seq_len)
            t = torch.tensor([flux_time_shift(mu, 1.0, float(v)) for v in t.clamp(1e-5, 1 - 1e-5)])
        elif self.shift is not None:
            t = time_snr_shift(self.shift, t)
        return t.float()

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = _expand(t, x0)
        return (1 - t) * x0 + t * noise

    def model_timestep(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.multiplier if self.multiplier != 1.0 else t

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return noise - x0


def flux_mu(seq_len: int, base_len: int = 256, max_len: int = 4096, base_shift: float = 0.5,
            max_shift: float = 1.15) -> float:
    slope = (max_shift - base_shift) / (max_len - base_len)
    return seq_len * slope + (base_shift - slope * base_len)


class DiscreteDiffusion:
    """DDPM-style eps or v prediction over ComfyUI's ``ModelSamplingDiscrete`` schedule (SD1/SDXL)."""

    def __init__(self, model_sampling, prediction: str = "eps"):
        if prediction not in ("eps", "v"):
            raise ValueError(prediction)
        self.prediction = prediction
        sigmas = model_sampling.sigmas.float().cpu()
        self.sigmas = sigmas
        self.alphas_cumprod = 1.0 / (sigmas ** 2 + 1.0)
        self.num_timesteps = len(sigmas)
        self._device_sigmas: dict[torch.device, torch.Tensor] = {}

    def sample_t(self, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.num_timesteps, (batch,), generator=generator).float()

    def quantile_t(self, q: float, seq_len: int) -> torch.Tensor:
        return torch.tensor([min(self.num_timesteps - 1, int(q * self.num_timesteps))]).float()

    def _coeffs(self, t, like):
        # sqrt(ac) = 1/sqrt(1 + sigma^2), sqrt(1 - ac) = sigma sqrt(ac): ComfyUI's calculate_input, without the
        # cancellation of 1 - ac in float32 at small t
        sigma = self._sigmas_on(like.device)[t.long()]
        a = (1 + sigma ** 2).rsqrt()
        return _expand(a, like), _expand(sigma * a, like)

    def _sigmas_on(self, device: torch.device) -> torch.Tensor:
        # copied once per device: a copy from pageable host memory waits for the device to finish its queue
        sigmas = self._device_sigmas.get(device)
        if sigmas is None:
            sigmas = self._device_sigmas[device] = self.sigmas.to(device, torch.float64)
        return sigmas

    def noisy(self, x0, noise, t):
        a, s = self._coeffs(t, x0)
        return a * x0 + s * noise

    def model_timestep(self, t):
        return t

    def target(self, x0, noise, t):
        if self.prediction == "eps":
            return noise
        a, s = self._coeffs(t, x0)
        return a * noise - s * x0


def mse_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(pred.dtype, torch.float32)
    return torch.nn.functional.mse_loss(pred.to(dtype), target.to(dtype))

