"""ZeroMQ CURVE keys and the loopback rule.

CURVE gives every connection authentication and encryption. It is off by default when every endpoint
is loopback (or ipc/inproc) and *required* when any endpoint is not: a channel refuses to open on a
non-loopback endpoint without keys. Keys are ZeroMQ certificate files (`generate_keys` writes them;
``python -m tidal.core.security DIR NAME`` does it from a shell).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from tidal.core.errors import SecurityError


def generate_keys(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write `NAME.key` (public) and `NAME.key_secret` (secret, mode 0600) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _load(path: str | os.PathLike[str], want_secret: bool) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise SecurityError(f"CURVE key file {path} does not exist; create keys with generate_keys()")
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except Exception as e:  # zmq raises ValueError/OSError with little context
        raise SecurityError(f"CURVE key file {path} is not a ZeroMQ certificate: {e}") from None
    if want_secret and not secret:
        raise SecurityError(f"CURVE key file {path} holds no secret key; pass the .key_secret file")
    return public, secret


def _load_pair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    public, secret = _load(path, want_secret=True)
    assert secret is not None  # _load refuses a file without one
    return public, secret


@dataclass(frozen=True, slots=True)
class CurveServer:
    """Server side of CURVE: this socket's key pair and, optionally, the client keys it accepts."""

    public_key: bytes  # Z85 public key of this server
    secret_key: bytes  # Z85 secret key of this server
    authorized_keys_dir: str | None = None  # folder of client `.key` files; None accepts any client with our key

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str], authorized_keys_dir: str | None = None) -> CurveServer:
        public, secret = _load_pair(secret_file)
        if authorized_keys_dir is not None and not Path(authorized_keys_dir).is_dir():
            raise SecurityError(f"authorized CURVE keys folder {authorized_keys_dir} does not exist")
        return cls(public, secret, authorized_keys_dir)


@dataclass(frozen=True, slots=True)
class CurveClient:
    """Client side of CURVE: the server's public key, and this client's key pair."""

    server_key: bytes  # Z85 public key of the server we connect to
    public_key: bytes  # Z85 public key of this client
    secret_key: bytes  # Z85 secret key of this client

    @classmethod
    def from_files(
        cls, server_public_file: str | os.PathLike[str], secret_file: str | os.PathLike[str] | None = None
    ) -> CurveClient:
        """Without `secret_file` the client uses a fresh ephemeral key pair (fine unless the server
        restricts clients to `authorized_keys_dir`)."""
        server, _ = _load(server_public_file, want_secret=False)
        if secret_file is None:
            public, secret = zmq.curve_keypair()
        else:
            public, secret = _load_pair(secret_file)
        return cls(server, public, secret)


Curve = CurveServer | CurveClient


def is_loopback(endpoint: str) -> bool:
    """True when traffic on `endpoint` cannot leave this host (loopback tcp, ipc, inproc)."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rsplit(":", 1)[0]
    # zmq allows "tcp://iface;host:port" for connect with a source address: check both halves.
    hosts = [h for h in host.split(";") if h]
    return bool(hosts) and all(_host_is_loopback(h) for h in hosts)


def _host_is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", "0.0.0.0"-style wildcards, interface names and DNS names may be reachable


def require_curve_if_remote(endpoint: str, curve: Curve | None) -> None:
    if curve is None and not is_loopback(endpoint):
        raise SecurityError(
            f"endpoint {endpoint} is not loopback, so CURVE authentication and encryption are required; "
            "pass curve=CurveServer.from_files(...) / CurveClient.from_files(...) (keys from "
            "`python -m tidal.core.security DIR NAME`), or use a 127.0.0.1 / ipc:// endpoint"
        )


_auth_lock = threading.Lock()
_authenticators: dict[int, tuple[int, ThreadAuthenticator]] = {}


def apply_curve(socket: zmq.Socket, curve: Curve | None) -> None:
    """Configure `socket` for CURVE (before bind/connect)."""
    if curve is None:
        return
    if isinstance(curve, CurveServer):
        socket.curve_secretkey = curve.secret_key
        socket.curve_publickey = curve.public_key
        socket.curve_server = True
        if curve.authorized_keys_dir is not None:
            domain = "tidal:" + str(Path(curve.authorized_keys_dir).resolve())
            socket.zap_domain = domain.encode()
            _authenticator(socket.context).configure_curve(domain=domain, location=curve.authorized_keys_dir)
    else:
        socket.curve_serverkey = curve.server_key
        socket.curve_publickey = curve.public_key
        socket.curve_secretkey = curve.secret_key


def _authenticator(ctx: zmq.Context) -> ThreadAuthenticator:
    # One ZAP handler per context and process; a forked child gets its own.
    with _auth_lock:
        key = id(ctx)
        entry = _authenticators.get(key)
        if entry is None or entry[0] != os.getpid():
            auth = ThreadAuthenticator(ctx)
            auth.start()
            _authenticators[key] = (os.getpid(), auth)
            return auth
        return entry[1]


@atexit.register
def _stop_authenticators() -> None:
    for pid, auth in list(_authenticators.values()):
        if pid == os.getpid():
            auth.stop()
    _authenticators.clear()


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print("usage: python -m tidal.core.security DIR NAME\n\nwrites DIR/NAME.key (public) and "
              "DIR/NAME.key_secret (secret, 0600): a ZeroMQ CURVE key pair for a Tidal endpoint")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    public, secret = generate_keys(argv[0], argv[1])
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
