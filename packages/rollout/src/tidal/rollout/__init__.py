"""tidal-rollout."""
