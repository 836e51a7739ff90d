"""ZeroMQ CURVE keys and the loopback rule.

CURVE gives every connection authentication and encryption. It is off by default when every endpoint
is loopback (or ipc/inproc) and *required* when any endpoint is not: a channel refuses to open on a
non-loopback endpoint without keys. Keys are ZeroMQ certificate files (`generate_keys` writes them;
``python -m tidal.core.security DIR NAME`` does it from a shell).

A run of several roles (tidal's launcher, or anyone wiring tidal-buffer alone) gives each role a
`ChannelSecurity`: its own key pair file, the public keys of the servers it connects to, and, for a
server, the public keys of the clients it lets in, by role name. `make_role_keys` makes one key pair per
role in an owner-only folder. A server socket then refuses (ZAP) every client key not on its list and
counts it (`AuthGuard.refused`); what it receives carries the sender's key (`Channel.sender`), which
`ChannelSecurity.role_of` turns into a role name for per-message role checks:

    sec = ChannelSecurity.from_role_keys("keys/", "buffer", clients=["learner", "driver"])
    serve = router("ipc:///run/serve", curve=sec.server(allow=["learner", "driver"], guard=guard))
    peer, msg = serve.recv(timeout=1); role = sec.role_of(serve.sender)   # "learner"
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from tidal.core.errors import SecurityError

log = logging.getLogger("tidal.security")


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
    # Z85 client public key -> role name: only these clients get in (with the folder's, if both are given)
    clients: Mapping[bytes, str] | None = None
    guard: AuthGuard | None = field(default=None, compare=False)  # counts refused clients; None: not counted
    name: str = ""  # what this socket is, for the refusal log ("buffer ingest")

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


class AuthGuard:
    """Counts what a server refused: connections whose client key is not on its list (ZAP) or whose
    CURVE handshake failed (no keys, a wrong server key: seen through a socket monitor, `watch`), and
    messages refused by a role check. A service publishes them (``auth/refused``, ``auth/role_refused``).
    Each refused peer address is logged once (ipc peers have none). `close` before closing the sockets."""

    _FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

    def __init__(self) -> None:
        self.refused = 0  # connections refused (incremented on the ZAP and monitor threads)
        self.role_refused = 0  # messages refused: an authorised client sent what its role may not send
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._watched: list[tuple[zmq.Socket, zmq.Socket, str]] = []  # (socket, its monitor, where)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refuse(self, where: str, address: str, why: str) -> None:
        with self._lock:
            self.refused += 1
        if (where, address) not in self._logged:
            self._logged.add((where, address))
            log.warning("%s: refused a client (%s; peer address %s): only this run's roles get in; a role "
                        "started by hand needs the run's keys (RUN_DIR/keys)", where or "server", why,
                        address or "n/a (ipc)")

    def refuse_role(self, where: str, role: str, what: str) -> None:
        self.role_refused += 1
        if (where, role + what) not in self._logged:
            self._logged.add((where, role + what))
            log.warning("%s: refused %s from %r: that role may not send it", where, what, role)

    def watch(self, socket: zmq.Socket, where: str) -> None:
        """Count failed CURVE handshakes on `socket` (a client without keys or with a wrong server key
        never reaches ZAP)."""
        self._watched.append((socket, socket.get_monitor_socket(self._FAILED), where))
        if self._thread is None:
            self._thread = threading.Thread(target=self._monitor, name="tidal-auth-monitor", daemon=True)
            self._thread.start()

    def _monitor(self) -> None:
        poller = zmq.Poller()
        while not self._stop.is_set():
            for _s, mon, _w in list(self._watched):
                poller.register(mon, zmq.POLLIN)
            for mon, _ in poller.poll(200):
                where = next((w for _s, m, w in self._watched if m is mon), "")
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.ZMQError:
                    continue
                self.refuse(where, event["endpoint"].decode("utf-8", "replace") if where else "",
                            f"CURVE handshake failed, error {event['value']}: no keys or a wrong server key")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        for sock, mon, _w in self._watched:
            if not sock.closed:
                sock.disable_monitor()
            mon.close(linger=0)
        self._watched.clear()

    def scalars(self) -> dict[str, float]:
        return {"auth/refused": float(self.refused), "auth/role_refused": float(self.role_refused)}


class _KeyList:
    """ZAP credentials provider: a fixed set of Z85 client keys (and a folder of `.key` files)."""

    def __init__(self, curve: CurveServer) -> None:
        keys = set(curve.clients or ())
        if curve.authorized_keys_dir is not None:
            for f in sorted(Path(curve.authorized_keys_dir).glob("*.key")):
                keys.add(_load(f, want_secret=False)[0])
        self.keys = frozenset(keys)
        self.curve = curve
        self.address = ""  # set by _Authenticator before each callback

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if self.curve.guard is not None:
            self.curve.guard.refuse(self.curve.name, self.address, f"key {key.decode()[:8]}... not authorised")
        return False


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, telling our key lists the peer's address (its callback gets only the key)."""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 6:
            provider = self.credentials_providers.get(msg[2].decode("utf-8", "replace"))
            if isinstance(provider, _KeyList):
                provider.address = msg[3].decode("utf-8", "replace")
        await super().handle_zap_message(msg)


_auth_lock = threading.Lock()
_authenticators: dict[int, tuple[int, ThreadAuthenticator]] = {}
_domains = iter(range(1, 1 << 62))


def apply_curve(socket: zmq.Socket, curve: Curve | None) -> None:
    """Configure `socket` for CURVE (before bind/connect)."""
    if curve is None:
        return
    if isinstance(curve, CurveServer):
        socket.curve_secretkey = curve.secret_key
        socket.curve_publickey = curve.public_key
        socket.curve_server = True
        if curve.authorized_keys_dir is not None or curve.clients is not None:
            # one ZAP domain per socket: each server socket has its own list of clients
            domain = f"tidal:{os.getpid()}:{next(_domains)}"
            socket.zap_domain = domain.encode()
            _authenticator(socket.context).configure_curve_callback(domain, _KeyList(curve))
        if curve.guard is not None:
            curve.guard.watch(socket, curve.name)
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
            auth = _Authenticator(ctx, log=logging.getLogger("tidal.security.zap"))
            auth.start()
            _authenticators[key] = (os.getpid(), auth)
            return auth
        return entry[1]


@atexit.register
def stop_authenticators() -> None:
    """Stop this process's ZAP handlers (their sockets would keep a context's term() waiting)."""
    for pid, auth in list(_authenticators.values()):
        if pid == os.getpid():
            auth.stop()
    _authenticators.clear()


def role_kind(name: str) -> str:
    """A role name's kind: "rollout-3" -> "rollout"; "learner" -> "learner"."""
    base, _, index = name.rpartition("-")
    return base if base and index.isdigit() else name


class ChannelSecurity(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One role's CURVE setup in a multi-role run (a field of each role's config). Empty (the default):
    no CURVE, plaintext, allowed on loopback / ipc only."""

    name: str = ""  # this role's name in the run ("buffer", "learner", "rollout-0", "driver", ...)
    secret_key: str = ""  # this role's key pair file (`<name>.key_secret`, mode 0600); "" = CURVE off
    servers: dict[str, str] = {}  # server role name -> its Z85 public key (the roles this one connects to)
    clients: dict[str, str] = {}  # client role name -> its Z85 public key: who may connect (servers only)

    @property
    def enabled(self) -> bool:
        return bool(self.secret_key)

    @classmethod
    def from_role_keys(cls, keys_dir: str | os.PathLike[str], name: str, *, servers: Iterable[str] = (),
                       clients: Iterable[str] = ()) -> ChannelSecurity:
        """The setup of role `name` from a folder `make_role_keys` filled."""
        keys_dir = Path(keys_dir)
        return cls(name=name, secret_key=str(keys_dir / f"{name}.key_secret"),
                   servers={s: public_key(keys_dir, s) for s in servers},
                   clients={c: public_key(keys_dir, c) for c in clients})

    def server(self, allow: Iterable[str] | None = None, guard: AuthGuard | None = None,
               where: str = "") -> CurveServer | None:
        """A CURVE server config letting in the listed clients whose name or kind is in `allow` (None: all
        listed clients); None when CURVE is off."""
        if not self.enabled:
            return None
        public, secret = _load_pair(self.secret_key)
        allow = None if allow is None else set(allow)
        keys = {k.encode(): n for n, k in self.clients.items()
                if allow is None or n in allow or role_kind(n) in allow}
        return CurveServer(public, secret, clients=keys, guard=guard, name=where or self.name)

    def client(self, server: str) -> CurveClient | None:
        """A CURVE client config for connecting to role `server`; None when CURVE is off."""
        if not self.enabled:
            return None
        if server not in self.servers:
            raise SecurityError(f"{self.name or 'this role'} has no public key for server {server!r} in its "
                                f"security.servers ({sorted(self.servers)}); add it (RUN_DIR/keys/{server}.key)")
        public, secret = _load_pair(self.secret_key)
        return CurveClient(self.servers[server].encode(), public, secret)

    def role_of(self, user_id: str | None) -> str | None:
        """The role name of an authenticated client (its User-Id is its Z85 key); None if unknown."""
        if user_id is None:
            return None
        for n, k in self.clients.items():
            if k == user_id:
                return n
        return None

    def permits(self, user_id: str | None, kinds: Iterable[str]) -> bool:
        """Whether the sender may send what only roles named or of a kind in `kinds` may. Always True with
        CURVE off (then nothing is authenticated: plaintext on loopback, as a standalone service runs)."""
        if not self.enabled:
            return True
        role = self.role_of(user_id)
        return role is not None and (role in kinds or role_kind(role) in kinds)


def public_key(keys_dir: str | os.PathLike[str], name: str) -> str:
    """Role `name`'s Z85 public key from `keys_dir/<name>.key`."""
    return _load(Path(keys_dir) / f"{name}.key", want_secret=False)[0].decode()


def owner_only_folder(folder: str | os.PathLike[str]) -> Path:
    """`folder`, made if missing and set owner-only (0700). One another user made first is refused
    (SecurityError): it could hold files or sockets of theirs in our place."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_uid != os.getuid():
        raise SecurityError(f"{folder} belongs to another user (uid {folder.stat().st_uid}): remove it, or use a "
                            f"folder of your own")
    os.chmod(folder, 0o700)
    return folder


def make_role_keys(keys_dir: str | os.PathLike[str], names: Iterable[str]) -> Path:
    """One CURVE key pair per role name in `keys_dir` (made 0700 by `owner_only_folder`; secret files 0600,
    written under an owner-only umask). A role whose pair exists keeps it: a restarted role, or a resumed
    run, reuses its keys."""
    keys_dir = owner_only_folder(keys_dir)
    old = os.umask(0o077)
    try:
        for name in names:
            if not (keys_dir / f"{name}.key_secret").is_file():
                generate_keys(keys_dir, name)
    finally:
        os.umask(old)
    return keys_dir


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
