"""What the fork server and its requesters say to each other, and a request read as untrusted input.

One connection per launch, on a unix stream socket:

1. the requester sends a 4-byte big-endian length with four descriptors attached (``SCM_RIGHTS``:
   the launch's stdin, stdout, stderr and report pipe), then that many bytes of JSON,
   ``{"argv": [WORLD, "--", ARGV...], "env": {NAME: VALUE}, "cwd": FOLDER, "python": PATH}``;
2. the server answers one line: ``refused WHY`` (the connection ends), or ``pid PID`` once it has
   forked the launch's zygote, which waits, in its own session, holding nothing but the launch's
   descriptors;
3. the requester sends :data:`RUN` if it still wants that zygote; only then does the zygote run
   the launch. A requester that gave up (past its own deadline) closes the connection instead, and
   the server ends the waiting zygote: a launch whose requester went on without it never runs, so
   a requester that falls back to a zygote of its own never runs the program twice;
4. the server answers ``exit STATUS`` once it reaped the zygote (as
   :attr:`subprocess.Popen.returncode`); the requester closing the connection ends the zygote.

The server reads a request with a deadline (:data:`REQUEST_READ_S` from the connection's accept to
its last byte, :data:`COMMIT_S` for step 3) and at most :data:`MAX_REQUEST_BYTES`; whatever does not
parse as the request above (:func:`parse_request`) is refused with one line naming the field. Pure
standard library. Serves the "nothing outlives the launch; a launch runs once" rule.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from dataclasses import dataclass

#: how long a requester waits for ``pid`` before it gives up and starts its zygote itself
GIVE_UP_S = 5.0
#: how long the server reads one request, from accepting the connection (a requester sends it at once)
REQUEST_READ_S = GIVE_UP_S
#: how long a forked zygote waits for :data:`RUN` (a requester sends it as soon as it reads ``pid``)
COMMIT_S = GIVE_UP_S
#: the largest request: twice Linux's default ``ARG_MAX`` (2 MiB, what ``execve`` takes for argv and
#: environment together), room for JSON's escapes; a launch that an interpreter could be started with fits
MAX_REQUEST_BYTES = 4 << 20
#: the largest world a request may ask for (the zygote forks one rank per member)
MAX_WORLD = 1 << 16
#: a served zygote whose requester left (or whose server stops) gets SIGTERM, then SIGKILL after this
GRACE_S = 3.0
DESCRIPTORS = 4  # stdin, stdout, stderr, the report pipe
RUN = b"run\n"  #: the requester's word that it still waits for the zygote it was told of
_HEADER = struct.Struct("!I")


class RequestError(Exception):
    """A request that is not one (see the module docstring); the message names the field and value."""


@dataclass(frozen=True)
class LaunchRequest:
    """A parsed request: the zygote's ``WORLD -- ARGV`` (``argv``, ``world``), the launch's
    environment, working folder and ``python``."""

    argv: tuple[str, ...]
    world: int
    env: dict[str, str]
    cwd: str
    python: str


def encode_request(argv: list[str], env: dict[str, str], cwd: str, python: str) -> tuple[bytes, bytes]:
    """The header (to carry the descriptors) and the body of a request (ASCII JSON: a name or value
    that is not UTF-8, held by Python as surrogates, travels as ``\\udcXX`` escapes)."""
    body = json.dumps({"argv": argv, "env": env, "cwd": cwd, "python": python}).encode()
    return _HEADER.pack(len(body)), body


def _text(field: str, value: object) -> str:
    """``value`` when it is a string a process can hold (no NUL, encodable as a file name)."""
    if not isinstance(value, str):
        raise RequestError(f"{field} must be a string, not {type(value).__name__}")
    if "\0" in value:
        raise RequestError(f"{field}={value[:80]!r} holds a NUL character")
    try:
        os.fsencode(value)
    except UnicodeError:
        raise RequestError(f"{field}={value[:80]!r} cannot be encoded") from None
    return value


def parse_request(body: bytes) -> LaunchRequest:
    """The request in ``body``, checked field by field; RequestError naming the first bad one."""
    try:
        data = json.loads(body.decode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the request is not JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request must be a JSON object, not {type(data).__name__}")
    missing = sorted({"argv", "env", "cwd", "python"} - set(data))
    if missing:
        raise RequestError(f"the request has no {missing[0]}")
    argv, env = data["argv"], data["env"]
    if not isinstance(argv, list) or len(argv) < 3:
        raise RequestError(f"argv must be a list [WORLD, '--', ARGV...], not {str(argv)[:80]}")
    argv = [_text(f"argv[{i}]", a) for i, a in enumerate(argv)]
    if not (argv[0].isascii() and argv[0].isdecimal() and 0 < int(argv[0]) <= MAX_WORLD):
        raise RequestError(f"argv[0]={argv[0][:80]!r} must be a world size in [1, {MAX_WORLD}]")
    if argv[1] != "--":
        raise RequestError(f"argv[1]={argv[1][:80]!r} must be '--'")
    if not isinstance(env, dict):
        raise RequestError(f"env must be an object of names to values, not {type(env).__name__}")
    for name, value in env.items():
        _text(f"env[{name[:80]!r}]", value)
        if not name or "=" in _text("an env name", name):
            raise RequestError(f"env name {name[:80]!r} is empty or holds '='")
    cwd = _text("cwd", data["cwd"])
    if not os.path.isabs(cwd) or not os.path.isdir(cwd):
        raise RequestError(f"cwd={cwd[:200]!r} is not an existing folder's absolute path")
    return LaunchRequest(tuple(argv), int(argv[0]), dict(env), cwd, _text("python", data["python"]))


class RequestReader:
    """One connection's request, read as it arrives on a non-blocking socket (the server reads many
    at once): :meth:`read` takes what is there and returns the request once it is whole."""

    def __init__(self, conn: socket.socket, now: float) -> None:
        self.conn = conn
        self.deadline = now + REQUEST_READ_S
        self.data = bytearray()
        self.fds: list[int] = []
        self.length: int | None = None

    def read(self) -> LaunchRequest | None:
        """The request once whole; None while more is to come. RequestError for a bad or oversized
        request, a connection closed early or more descriptors than :data:`DESCRIPTORS`."""
        while True:
            want = _HEADER.size - len(self.data) if self.length is None else self.length - len(self.data)
            try:
                chunk, fds, flags, _ = socket.recv_fds(self.conn, min(want, 1 << 16), DESCRIPTORS)
            except BlockingIOError:
                return None
            self.fds.extend(fds)
            if flags & socket.MSG_CTRUNC or len(self.fds) > DESCRIPTORS:
                raise RequestError(f"more than {DESCRIPTORS} descriptors came with the request")
            if not chunk:
                raise RequestError("the requester left before its request was whole")
            self.data += chunk
            if self.length is None and len(self.data) == _HEADER.size:
                (self.length,) = _HEADER.unpack(self.data)
                self.data.clear()
                if self.length > MAX_REQUEST_BYTES:
                    raise RequestError(f"a request of {self.length} bytes is over {MAX_REQUEST_BYTES}")
            if self.length is not None and len(self.data) == self.length:
                if len(self.fds) != DESCRIPTORS:
                    raise RequestError(f"{len(self.fds)} descriptors came with the request, "
                                       f"not {DESCRIPTORS}")
                return parse_request(bytes(self.data))

    def expired(self, now: float) -> bool:
        return now >= self.deadline

    def close_fds(self) -> None:
        """Close the descriptors received (a request refused, or handed on: the caller duplicated them)."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def seconds_left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), never negative."""
    return max(deadline - time.monotonic(), 0.0)
