"""tidal.algos: RL post-training math as plain torch functions over [batch, tokens] tensors.

    from tidal.algos import LossInputs, grpo_advantages, to_tokens, ppo_loss

Names are imported lazily, so that `tidal.algos.filters` (pure Python; the buffer uses it) and the plugin
module load without torch.
"""

from __future__ import annotations

from tidal.core.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "AGG_MODES": "aggregation",
    "AdvantageInputs": "estimators",
    "AdvantageOutputs": "estimators",
    "KL_ESTIMATORS": "kl",
    "LengthFilter": "filters",
    "LossInputs": "types",
    "LossOutputs": "types",
    "ZeroVarianceFilter": "filters",
    "aggregate": "aggregation",
    "cispo_loss": "losses",
    "discounted_returns": "advantages",
    "distillation_advantages": "losses",
    "distillation_loss": "losses",
    "dr_grpo_advantages": "advantages",
    "entropy_from_logits": "kl",
    "gae_advantages": "advantages",
    "grpo_advantages": "advantages",
    "grpo_process_advantages": "advantages",
    "gspo_loss": "losses",
    "has_reward_variance": "filters",
    "kl_estimate": "kl",
    "kl_penalty": "kl",
    "last_token_rewards": "advantages",
    "masked_mean": "aggregation",
    "m2po_loss": "offpolicy",
    "m2po_mask": "offpolicy",
    "masked_whiten": "aggregation",
    "oapl_advantages": "offpolicy",
    "oapl_loss": "offpolicy",
    "opo_advantages": "advantages",
    "overlong_penalty": "shaping",
    "ppo_loss": "losses",
    "reinforce_loss": "losses",
    "reinforce_pp_advantages": "advantages",
    "rloo_advantages": "advantages",
    "step_rewards_to_tokens": "advantages",
    "to_tokens": "advantages",
    "topr_loss": "offpolicy",
    "value_loss": "losses",
    # the catalogue ported from other frameworks
    "dppo_loss": "losses",
    "gmpo_loss": "losses",
    "gpg_advantages": "advantages",
    "kl_cov_loss": "losses",
    "passk_advantages": "advantages",
    "remax_advantages": "advantages",
    "sapo_loss": "losses",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
