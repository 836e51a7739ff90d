"""Shared helpers of the loss tests, as fixtures (tests here are imported by path, not as a package)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tidal.algos import LossInputs


def make_inputs(log_ratio, adv, mask=None, old=None, logp=None, dtype=torch.float64, **kw: Any) -> LossInputs:
    """LossInputs whose token log-ratio log(pi / pi_behaviour) is exactly `log_ratio`: around the behaviour
    logprobs `old` (default -1 everywhere) or, given `logp`, around those current logprobs. The current
    logprobs are a leaf that requires grad."""
    lr = torch.tensor(log_ratio, dtype=dtype)
    if logp is None:
        behaviour = torch.full_like(lr, -1.0) if old is None else torch.tensor(old, dtype=dtype)
        current = behaviour + lr
    else:
        current = torch.tensor(logp, dtype=dtype)
        behaviour = current - lr
    mask = torch.ones_like(lr, dtype=torch.bool) if mask is None else torch.tensor(mask).bool()
    return LossInputs(logprobs=current.detach().requires_grad_(), behaviour_logprobs=behaviour,
                      advantages=torch.tensor(adv, dtype=dtype), mask=mask, **kw)


def loss_grad(out, inp: LossInputs) -> torch.Tensor:
    """The gradient of `out.loss` with respect to the inputs' current logprobs."""
    out.loss.backward()
    return inp.logprobs.grad


@pytest.fixture
def inputs() -> Callable[..., LossInputs]:
    return make_inputs


@pytest.fixture
def grad() -> Callable[..., torch.Tensor]:
    return loss_grad
