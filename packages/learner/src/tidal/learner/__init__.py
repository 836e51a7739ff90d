"""tidal.learner: the learner of an async RL loop, by its seams.

- a `BatchSource` (sources.py): `BufferSource` (a buffer client, prefetching the next batch while a step
  trains, acknowledgements riding on the next request), `ReplaySource` (a recorded run, no buffer);
- your trainer: one optimizer step per batch (`learner.Trainer`, a protocol);
- a `Checkpointer` (checkpoint.py): when, in the background or not, and which trained batches a finished
  checkpoint lets the source acknowledge (exactly once across kills);
- a `Publisher` (publisher.py): weights through a tidal-weight-sync transport found by name, metrics;

joined by `loop.run` (loop.py) on a `Learner` (learner.py).
"""

from __future__ import annotations

__version__ = "0.1.0"
