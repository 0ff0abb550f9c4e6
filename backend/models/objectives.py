"""Training objectives, each its own object: how a clean latent is noised, what the network should
predict, and which timesteps are drawn. The noise schedules come from ComfyUI's ``model_sampling``."""
from __future__ import annotations

from dataclasses import dataclass, field

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
    ``min_t`` / ``max_t`` (``[model]``, diffusion-pipe's Wan keys, here for every flow model): timesteps are
    drawn from that (shifted) distribution restricted to [min_t, max_t]: the quantiles of the two bounds are
    found and the range between them sampled uniformly, so the draws follow the full distribution
    conditioned on the range (as the two experts of Wan 2.2 14B divide it).
    """
    sample_method: str = "logit_normal"
    sigmoid_scale: float = 1.0
    shift: float | None = None
    flux_shift: bool = False
    multiplier: float = 1.0
    min_t: float = 0.0
    max_t: float = 1.0
    # the quantiles of min_t and max_t by sequence length and the fields they depend on: a bisection of 40 rounds,
    # which every draw ran again (a run draws a timestep a sample; a run's sequence lengths are its few buckets)
    _q_ranges: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_model_config(cls, c, default_shift: float | None = None, multiplier: float = 1.0) -> "FlowMatching":
        """The objective a ``[model]`` table asks for: its ``shift`` wins over ``flux_shift`` (diffusion-pipe's
        order), and ``default_shift`` (the model's own) applies when it sets neither."""
        shift = c.shift if c.shift is not None else (None if c.flux_shift else default_shift)
        return cls(sample_method=c.timestep_sample_method, sigmoid_scale=c.sigmoid_scale, shift=shift,
                   flux_shift=c.flux_shift and c.shift is None, multiplier=float(multiplier), min_t=c.min_t,
                   max_t=c.max_t)

    def shift_text(self) -> str | None:
        """The shift applied to the drawn timesteps, in words (check-config); None: none."""
        if self.shift is not None:
            return f"a constant shift of {self.shift:.4g}"
        return "Flux's resolution-dependent shift (flux_shift)" if self.flux_shift else None

    @property
    def ranged(self) -> bool:
        return (self.min_t, self.max_t) != (0.0, 1.0)

    def sample_t(self, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        if self.ranged:
            q0, q1 = self._q_range(seq_len)
            u = torch.rand(batch, generator=generator, dtype=torch.float64)
            return self._t_of_q(q0 + u * (q1 - q0), seq_len).clamp(self.min_t, self.max_t)
        if self.sample_method == "logit_normal":
            t = torch.sigmoid(torch.randn(batch, generator=generator) * self.sigmoid_scale)
        else:
            t = torch.rand(batch, generator=generator)
        return self._shift(t, seq_len)

    def quantile_t(self, q: float, seq_len: int) -> torch.Tensor:
        """The q-quantile of the timestep distribution ``sample_t`` draws from (eval at fixed timesteps)."""
        if self.ranged:
            q0, q1 = self._q_range(seq_len)
            return self._t_of_q((q0 + q * (q1 - q0)).reshape(1), seq_len).clamp(self.min_t, self.max_t)
        q = torch.tensor([q], dtype=torch.float64)
        if self.sample_method == "logit_normal":
            t = torch.sigmoid(torch.special.ndtri(q) * self.sigmoid_scale)
        else:
            t = q
        return self._shift(t.float(), seq_len)

    def _t_of_q(self, q: torch.Tensor, seq_len: int) -> torch.Tensor:
        q = q.double().clamp(1e-7, 1 - 1e-7)
        t = torch.sigmoid(torch.special.ndtri(q) * self.sigmoid_scale) if self.sample_method == "logit_normal" else q
        return self._shift(t.float(), seq_len)

    def _q_range(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantiles of min_t and max_t, by bisection (the shifted distribution's CDF has no common closed form),
        found once for each sequence length."""
        key = (seq_len, self.sample_method, self.sigmoid_scale, self.shift, self.flux_shift, self.min_t, self.max_t)
        if key not in self._q_ranges:
            self._q_ranges[key] = self._bisect_q_range(seq_len)
        return self._q_ranges[key]

    def _bisect_q_range(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        bounds = torch.tensor([self.min_t, self.max_t])
        lo, hi = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
        for _ in range(40):
            mid = (lo + hi) / 2
            below = self._t_of_q(mid, seq_len) < bounds
            lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
        q = (lo + hi) / 2
        q[0] = 0.0 if self.min_t <= 0 else q[0]
        q[1] = 1.0 if self.max_t >= 1 else q[1]
        return q[0], q[1]

    def loss_weights(self, t: torch.Tensor) -> torch.Tensor | None:
        """Per-sample loss weights (None: every sample counts the same, as diffusion-pipe's flow models)."""
        return None

    def _shift(self, t: torch.Tensor, seq_len: int) -> torch.Tensor:
        from comfy.model_sampling import flux_time_shift, time_snr_shift

        if self.shift is not None:   # a constant shift wins over flux_shift, as in diffusion-pipe
            t = time_snr_shift(self.shift, t)
        elif self.flux_shift:
            mu = flux_mu(seq_len)
            t = torch.tensor([flux_time_shift(mu, 1.0, float(v)) for v in t.clamp(1e-5, 1 - 1e-5)])
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

    def __init__(self, model_sampling, prediction: str = "eps", min_snr_gamma: float | None = None,
                 debiased: bool = False):
        if prediction not in ("eps", "v"):
            raise ValueError(prediction)
        self.prediction = prediction
        self.min_snr_gamma, self.debiased = min_snr_gamma, debiased
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

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """The signal-to-noise ratio alphas_cumprod / (1 - alphas_cumprod) at integer timesteps t: 1 / sigma^2
        in ComfyUI's parametrisation (float64)."""
        sigma = self._sigmas_on(t.device)[t.long()]   # on t's device: no host sync in the loss
        return 1.0 / sigma ** 2

    def loss_weights(self, t: torch.Tensor) -> torch.Tensor | None:
        """diffusion-pipe's SDXL weights (its ``min_snr_gamma`` and ``debiased_estimation_loss``, the weights
        sd-scripts defined): min-SNR min(SNR, gamma) / SNR (v-prediction: / (SNR + 1)); debiased estimation
        1 / sqrt(SNR) (v-prediction: 1 / (SNR + 1)), SNR capped at 1000 there (it is largest at t = 0); both
        multiply. None when neither is set."""
        if self.min_snr_gamma is None and not self.debiased:
            return None
        snr = self.snr(t)
        w = torch.ones_like(snr)
        if self.min_snr_gamma is not None:
            w = w * snr.clamp(max=self.min_snr_gamma) / (snr + 1 if self.prediction == "v" else snr)
        if self.debiased:
            capped = snr.clamp(max=1000.0)
            w = w / (capped + 1 if self.prediction == "v" else capped.sqrt())
        return w.float()
