"""The bubblewrap command that runs one program of the model's in a sandbox.

What the program sees (everything else does not exist for it):
- a read-only root holding /usr, /bin, /lib*, /sbin, the few /etc files the dynamic loader and the C
  library read, and the Python installation the base interpreter runs from (``sys.base_prefix``; its
  site-packages hidden under an empty read-only folder, so only the standard library imports) — no home,
  no project checkout, no virtualenv, no run folder, nothing else of /root or the host's /tmp;
- /tmp, its cwd, HOME and TMPDIR and the only writable place: an empty tmpfs of `disk_mb` of its own
  (never the host's disk, which it could fill; its pages count towards a cgroup's memory), gone with the
  sandbox;
- its own /proc (its own processes only; read-only) and a minimal /dev;
- namespaces of its own: user (uid and gid 65534, no capabilities), pid (bubblewrap's init is pid 1:
  when the program exits or the sandbox is killed, every process left inside dies with it, daemons
  included), network (only a loopback of its own), ipc, uts and cgroup; a new session (no terminal);
- an environment of PATH, HOME, TMPDIR, LANG and thread counts only;
- no user namespaces of its own (``--disable-userns``, bubblewrap 0.8+): they are a favourite way into
  kernel bugs.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig

INSTALL = ("install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`) "
           "and check that `bwrap --unshare-all --die-with-parent --ro-bind / / true` exits 0 as the user "
           "that runs the environment processes")
UID = 65534  # nobody, inside the sandbox's user namespace
WORK = "/tmp"  # the sandbox's own, writable folder
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf")
_TOP = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing, or cannot start a sandbox on this machine."""


def interpreter() -> str:
    """The base interpreter the virtualenv's python points at: the sandbox runs it with no venv."""
    real = os.path.realpath(sys.executable)
    base = os.path.realpath(sys.base_prefix)
    if not real.startswith(base + os.sep) and not real.startswith("/usr/"):
        raise SandboxUnavailable(f"the interpreter {real} lies outside the Python installation {base} and "
                                 "/usr, so the sandbox cannot show it without showing more; run the tool from "
                                 "a Python whose executable sits in its installation (pyenv, system, uv's "
                                 "managed pythons all do)")
    return real


def _site_packages(base: str) -> list[str]:
    paths = sysconfig.get_paths(scheme="posix_prefix", vars={"base": base, "platbase": base})
    return sorted({p for p in (paths["purelib"], paths["platlib"]) if os.path.isdir(p)})


def command(bwrap: str, argv: list[str], disk_mb: int = 64) -> list[str]:
    """bwrap's argv that runs `argv` inside the sandbox."""
    nested = ["--disable-userns"] if "--disable-userns" in options(bwrap) else []
    cmd = [bwrap, "--unshare-user", "--uid", str(UID), "--gid", str(UID), "--unshare-pid", "--unshare-net",
           "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox",
           *nested, "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    for top in _TOP:
        path = "/" + top
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    for name in _ETC:
        if os.path.exists("/etc/" + name):
            cmd += ["--ro-bind", "/etc/" + name, "/etc/" + name]
    base = os.path.realpath(sys.base_prefix)
    if base != "/usr" and not base.startswith("/usr/"):  # pyenv, uv's pythons: only that folder shows
        cmd += ["--ro-bind", base, base]
    for site in _site_packages(base):  # an empty folder over it, then read-only
        cmd += ["--tmpfs", site, "--remount-ro", site]
    # /proc read-only as a whole: run by root, the sandbox's uid is root outside it (without
    # capabilities), and root may write /proc/sys files, which bwrap leaves writable
    cmd += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev",
            "--size", str(disk_mb * 1024 * 1024), "--perms", "0700", "--tmpfs", WORK, "--chdir", WORK,
            "--remount-ro", "/"]
    env = {"PATH": "/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK, "LANG": "C.UTF-8",
           "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    for name, value in env.items():
        cmd += ["--setenv", name, value]
    return [*cmd, "--", *argv]


@functools.cache
def options(bwrap: str) -> str:
    """bwrap's --help: which options this version has."""
    try:
        return subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


@functools.cache  # a failure raises, and is not cached
def find() -> str:
    """The bwrap program, once proven to start a sandbox running our interpreter; raises
    SandboxUnavailable saying what failed and how to fix it."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"the python tool needs bubblewrap (bwrap), which is not on PATH: {INSTALL}")
    try:
        done = subprocess.run(command(bwrap, [interpreter(), "-I", "-c", "print(6*7)"]),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=30, env={})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"{bwrap} could not start a sandbox: {e}; {INSTALL}") from e
    if done.returncode != 0 or done.stdout != b"42\n":
        why = done.stderr.decode(errors="replace").strip()[-500:]
        raise SandboxUnavailable(f"{bwrap} could not start a sandbox here (exit status {done.returncode}: "
                                 f"{why}); user namespaces may be off (sysctl kernel.unprivileged_userns_clone"
                                 f"=1, or apparmor's restrict_unprivileged_userns=0 on Ubuntu 24.04+), or {INSTALL}")
    return bwrap
