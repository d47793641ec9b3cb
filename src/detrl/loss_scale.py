"""Dynamic loss scaling for a float16 compute copy (`model.dtype=float16`), with float32 master weights.

float16 has 5 exponent bits: gradients below ~6e-8 flush to zero in the half-precision backward. The loss is
multiplied by a scale before the backward, the float32 master gradients are divided by it before clipping, and
a step whose gradients hold an inf / NaN is skipped and halves the scale (it doubles after `growth_interval`
clean steps): torch.amp.GradScaler's algorithm, used as is. float32 and bfloat16 (float32's exponent range)
need none: the scaler is then disabled and changes no bit.
"""

from __future__ import annotations

import torch

from detrl.config import ConfigError


class LossScaler:
    def __init__(
        self,
        dtype: torch.dtype,
        device: torch.device,
        init_scale: float = 2.0**12,
        growth_interval: int = 200,
    ):
        self.enabled = dtype == torch.float16
        if self.enabled and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ConfigError(
                "model.dtype=float16 is not valid under torchrun yet (the loss scale would need one skip "
                "decision for all ranks); use model.dtype=bfloat16 or one process"
            )
        # torch's defaults are 2**16 and 2000 steps: at 2**16 the tiny default model's first optimizer steps
        # overflowed (5 of 6 skipped in a 3-step run); a lower start and a shorter growth interval suit short runs
        self.scaler = torch.amp.GradScaler(
            device.type, init_scale=init_scale, growth_interval=growth_interval, enabled=self.enabled
        )
        self.skipped = 0  # optimizer steps skipped for non-finite gradients, this update

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, opt: torch.optim.Optimizer) -> None:
        """The master gradients back to their true size (before clipping); records whether any is inf/NaN."""
        if self.enabled and _has_grad(opt):
            self.scaler.unscale_(opt)

    def step(self, opt: torch.optim.Optimizer) -> None:
        """opt.step(), unless the unscaled gradients hold an inf / NaN; then adjust the scale."""
        if not self.enabled or not _has_grad(
            opt
        ):  # no gradient (no token trained): nothing to check or scale
            opt.step()
            return
        before = self.scaler.get_scale()
        self.scaler.step(opt)
        self.scaler.update()
        self.skipped += int(self.scaler.get_scale() < before)  # update() halves the scale iff it skipped

    def metrics(self) -> dict[str, float]:
        """actor/loss_scale and actor/skipped_steps (this update), float16 runs only."""
        if not self.enabled:
            return {}
        out = {"actor/loss_scale": float(self.scaler.get_scale()), "actor/skipped_steps": float(self.skipped)}
        self.skipped = 0
        return out

    def state_dict(self) -> dict:
        return self.scaler.state_dict()


def _has_grad(opt: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for g in opt.param_groups for p in g["params"])
