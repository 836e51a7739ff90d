"""Tiny local models for the rollout tests (built once per session, no hub)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-moe") / "model", experts=4, experts_per_token=2, seed=2)


@pytest.fixture(scope="session")
def tiny_oss(tmp_path_factory):
    """GPT-OSS-like: MoE (biased router, clamped SwiGLU experts) and attention sinks in every layer."""
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-oss") / "model", arch="gpt_oss", experts=4,
                            experts_per_token=2, seed=3)
