"""What every role's process sets up first, the same way in each (buffer, learner, rollout worker)."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from tidal.core.errors import ConfigError, PluginNotFound

log = logging.getLogger("tidal.role")

# sysexits' EX_CONFIG: the role refused its configuration. Restarting it cannot help, so the driver
# ends the run at once with the role's message instead.
EXIT_CONFIG = 78
# where a role writes the message of the error it exits on (one paragraph), for the driver to show
ERROR_FILE_ENV = "TIDAL_ERROR_FILE"


def setup_role_process(log_level: str | int = "INFO") -> None:
    """Log lines with time and source; `kill -USR1 PID` writes every thread's Python stack to the log
    (stderr) and the role goes on: where a role that seems stuck is."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def cpu_seconds(pid: int | str = "self", thread: int | None = None) -> float:
    """User + system CPU seconds that process `pid` (all its threads), or its thread `thread`, has used so
    far, from Linux's /proc; ProcessLookupError once it is gone. For benchmarks and diagnostics."""
    where = f"/proc/{pid}/task/{thread}/stat" if thread is not None else f"/proc/{pid}/stat"
    try:
        fields = Path(where).read_text().rsplit(")", 1)[1].split()
    except OSError as e:
        raise ProcessLookupError(f"{where}: {e.strerror or e}") from None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exit_now(code: int = 0, zmq_flush_s: float = 2.0) -> NoReturn:
    """End this process with `code` once its work is done, skipping the interpreter's finalization
    (logging and stdio are flushed first; atexit handlers do not run). For a process that ran
    torch.distributed over gloo: a C++ thread of the process group or its store that is still joinable
    when finalization destroys it aborts the process with 'terminate called without an active exception'
    (exit -6) after all its work succeeded. CI saw it on 2-rank FSDP2 and DeepSpeed ZeRO-3 jobs even after
    a barrier and destroy_process_group. Call it after those, on the clean path only: an error should
    still unwind and print its traceback.

    Messages still queued on ZeroMQ sockets the process closed (a last metrics row, a last announcement)
    leave first: the global context is terminated on a thread, which returns once they are sent or their
    sockets' linger is over, waited for up to `zmq_flush_s` (a socket left open would make it wait for
    ever: then the process ends anyway)."""
    zmq = sys.modules.get("zmq")
    security = sys.modules.get("tidal.core.security")
    if security is not None:  # a ZAP handler's sockets would hold term() for all of zmq_flush_s
        security.stop_authenticators()
    if zmq is not None and zmq_flush_s > 0:
        t = threading.Thread(target=zmq.Context.instance().term, name="tidal-zmq-flush", daemon=True)
        t.start()
        t.join(zmq_flush_s)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to save
            pass
    os._exit(code)


def write_role_error(message: str) -> None:
    """Leave `message` where the process that started this role looks for it (no-op when unset)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(message.rstrip() + "\n")
        except OSError as e:  # the log still has it
            log.warning("could not write the error file %s: %s", path, e)


def role_main(main: Callable[[], int], role: str) -> int:
    """Run a role's main. A configuration it refuses ends it with EXIT_CONFIG and its message in the
    error file; any other exception is written there too and propagates (the driver may restart)."""
    try:
        return main()
    except (ConfigError, PluginNotFound) as e:
        where = f" (field {e.field})" if isinstance(e, ConfigError) and e.field and e.field not in str(e) else ""
        message = f"{role} refused its configuration: {e}{where}"
        log.error("%s", message)
        write_role_error(message)
        return EXIT_CONFIG
    except BaseException as e:
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            write_role_error(f"{role} failed: {type(e).__name__}: {e}")
        raise

