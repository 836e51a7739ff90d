"""Every staleness policy is found by name through the `tidal` entry point, with its config Struct."""

from __future__ import annotations

import pytest
import torch

from tidal.core.config import convert
from tidal.core.interfaces import AdmissionPolicy, CorrectionPolicy
from tidal.core.plugins import Registry
from tidal.staleness.config import MaskedISConfig, VersionRejectionConfig
from tidal.staleness.correction import FACTORIES, CorrectionInputs
from tidal.staleness.rejection import VersionRejection


def test_all_policies_registered():
    reg = Registry()
    assert reg.names("admission") == ["version_rejection"]
    assert set(reg.names("correction")) == {"tis", "seq_tis", "masked_is", "off_policy_seq_mask", "decoupled_ppo",
                                            "icepop", "kv_lag_mask"}
    assert isinstance(reg.create("admission", "version_rejection", max_lag=2), AdmissionPolicy)
    assert all(isinstance(reg.create("correction", n), CorrectionPolicy) for n in reg.names("correction"))


def test_policies_build_from_their_config_structs():
    cfg = convert({"max_lag": 1, "mode": "mask"}, VersionRejectionConfig)
    assert VersionRejection.from_config(cfg).admit([0, 1, 2], 2).token_mask == [False, True, True]
    for name, (cls, cfg_type) in FACTORIES.items():
        policy = cls(**{f: getattr(cfg_type(), f) for f in cfg_type.__struct_fields__})
        lp = torch.zeros(1, 2)
        out = policy(CorrectionInputs(learner_logprobs=lp, behaviour_logprobs=lp, mask=torch.ones(1, 2, dtype=torch.bool),
                                      advantages=torch.zeros(1), proximal_logprobs=lp))
        assert out.mask.all(), name


def test_bad_config_names_the_field():
    from tidal.core import ConfigError

    with pytest.raises(ConfigError, match="level"):
        convert({"level": "batch"}, MaskedISConfig)
