"""The rollout worker process (`process`, run as ``python -m tidal.rollout.worker.process``): its config,
how it scores samples, makes trajectories, writes transcripts, and applies new weights in flight."""
