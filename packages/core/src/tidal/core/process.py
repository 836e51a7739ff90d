"""What every role's process sets up first, the same way in each (buffer, learner, rollout worker)."""

from __future__ import annotations

import faulthandler
import logging
import signal


def setup_role_process(log_level: str | int = "INFO") -> None:
    """Log lines with time and source; `kill -USR1 PID` writes every thread's Python stack to the log
    (stderr) and the role goes on: where a role that seems stuck is."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, all_threads=True)
