"""CurveZMQ keys for the TCP client transport: create, load, apply to a socket.

Key files are zmq.auth certificates: `NAME.key` holds the public key (share it:
the server's goes to clients, a client's goes into the sidecar's authorized-keys
directory), `NAME.key_secret` holds both keys and stays with its owner, mode
0600. A secret file that others can read is refused, as ssh does. The directory
they are written to is made 0700; an existing one must already be private to its
owner (mode 0700 or tighter, owned by this user): it is refused rather than
tightened, since it may be shared on purpose (`--out /tmp` must not lock out others).
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import zmq
import zmq.auth

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_Z85_KEY_LEN = 40


def write_keypair(out_dir: os.PathLike, name: str) -> tuple[Path, Path]:
    """Create OUT/NAME.key (0644) and OUT/NAME.key_secret (0600); never overwrite."""
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid key name {name!r}: use letters, digits, '_', '-' or '.'")
    out = Path(out_dir)
    try:
        out.mkdir(mode=0o700, parents=True)
        os.chmod(out, 0o700)     # exactly 0700, whatever the umask
    except FileExistsError:
        _check_private_dir(out)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists; remove it or pick another --name")
    old = os.umask(0o077)  # the secret is never readable by others, not even for an instant
    try:
        zmq.auth.create_certificates(out, name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def _check_private_dir(path: Path) -> None:
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} exists and is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise PermissionError(f"{path} is accessible by others (mode {mode:04o}): chmod 700 it, "
                              f"or give a new directory for --out")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user (uid "
                              f"{os.geteuid()}): give a directory of your own for --out")


def load_secret_keypair(path: os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a .key_secret file that only its owner can read."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise PermissionError(f"CURVE secret key {path} is readable by others "
                              f"(mode {mode:04o}); chmod 600 it")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (give the .key_secret file)")
    return public, secret


def load_public_key(key_or_path) -> bytes:
    """A z85 public key given as itself (40 characters) or as a .key/.key_secret file."""
    if isinstance(key_or_path, (str, bytes)) and len(key_or_path) == _Z85_KEY_LEN \
            and not os.path.exists(key_or_path):
        key = key_or_path.encode() if isinstance(key_or_path, str) else key_or_path
    else:
        key, _ = zmq.auth.load_certificate(key_or_path)
    if len(key) != _Z85_KEY_LEN:
        raise ValueError(f"not a z85 CURVE public key: {key!r}")
    return key


def apply_client_curve(sock: zmq.Socket, server_key, secret_key_file: os.PathLike) -> None:
    """Make `sock` a CURVE client of the server whose public key is `server_key`.

    Call before connect(). Shared by the sync and async SDK clients.
    """
    public, secret = load_secret_keypair(secret_key_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = load_public_key(server_key)
