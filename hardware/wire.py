"""The control wire of ``hardware.protocol``: message framing, error answers, payload MACs.

A message is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON holding one
object: at most ``MAX_HELLO`` bytes before the sender has shown the token, ``MAX_MESSAGE``
after. ``send_msg``/``recv_msg`` frame it on a blocking socket (the workers, Algorithm 1),
``write_frame``/``read_frame`` on asyncio streams (the router): one encoding for both. A
failed request is answered ``{"ok": false, "error": NAME, "message": ...}`` where ``NAME`` is
one of ``ERRORS`` (anything else is sent as ``ProtocolError``); the other side raises the
same class again (``raise_for_reply``).

Deadlines. ``recv_msg`` waits for a message to start for the socket's own timeout
(``NoMessage``, a ``TransferTimeout``, when none does); once its first byte has arrived the
whole message must arrive within ``frame_s`` (``TransferTimeout`` naming how much came), so a
peer that sends half a frame and goes silent holds no one. ``send_msg`` finishes within the
socket's timeout or raises ``TransferTimeout``.

Integrity. The sender MACs every ``segment_bytes`` slice of the payload with HMAC-SHA256,
keyed by the run's token and bound to the request id, a per-pull nonce, the payload size and
the segment's index (``segment_macs``); the receiver computes the same over the bytes as they
landed (``received_macs``). A flipped byte, a segment moved, or bytes written by anyone who
lacks the token are caught; CRC32 would catch only the first.

Reading raises only the transport's own exceptions: ``PeerLost`` on EOF or reset,
``TransferTimeout`` as above, ``ProtocolError`` for an oversized, non-JSON or non-object
message.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hardware.transfer_plan import TransferPlan
from hardware.transport.base import (
    AuthError, ChecksumMismatch, PeerLost, ProtocolError, SendBufferExhausted, TransferTimeout,
    UnknownRequest,
)

MAX_MESSAGE = 64 << 20        # bytes of one message from a peer that showed the token
MAX_HELLO = 64 << 10          # bytes of one message before that
MIN_TOKEN = 16                # characters of the shared secret
ERRORS = {cls.__name__: cls for cls in (AuthError, UnknownRequest, SendBufferExhausted,
                                        ChecksumMismatch, ProtocolError)}


def new_token() -> str:
    """A fresh per-run secret (32 hex characters)."""
    return secrets.token_hex(16)


#: the environment variable that hands a run's token to the processes it starts
TOKEN_ENV = "HAWK_RUN_TOKEN"


def token_from_env() -> str:
    """The run token from ``TOKEN_ENV``, checked as ``check_token`` checks it."""
    token = os.environ.get(TOKEN_ENV, "")
    try:
        check_token(token)
    except ValueError as e:
        raise ValueError(f"set {TOKEN_ENV} to the run token: {e}") from None
    return token


def check_token(token) -> bytes:
    """The token's bytes; ``ValueError`` unless it is a printable ASCII secret that long."""
    if not isinstance(token, str) or len(token) < MIN_TOKEN or not token.isascii() \
            or not token.isprintable():
        raise ValueError(f"token: a printable ASCII secret of at least {MIN_TOKEN} "
                         f"characters is required (use hardware.protocol.new_token())")
    return token.encode()


def field(msg: dict, name: str, kind: type, default=None):
    """``msg[name]``, checked to be a ``kind`` (``default`` when absent, if given)."""
    if name not in msg and default is not None:
        return default
    value = msg.get(name)
    if not isinstance(value, kind):
        raise ProtocolError(f"field {name!r}: expected a JSON "
                            f"{ {str: 'string', dict: 'object', bool: 'boolean'}[kind]}, got "
                            f"{type(value).__name__}")
    return value


class NoMessage(TransferTimeout):
    """No message started within the socket's timeout (an idle peer, not a broken one)."""


HEADER = struct.Struct("!I")          # the body's length in bytes


def encode(msg: dict) -> bytes:
    """``msg`` as one frame: its length, then its UTF-8 JSON."""
    body = json.dumps(msg).encode()
    return HEADER.pack(len(body)) + body


def body_length(head: bytes, peer: str, max_bytes: int) -> int:
    """The length a frame's header announces; ``ProtocolError`` past ``max_bytes``."""
    (n,) = HEADER.unpack(head)
    if n > max_bytes:
        raise ProtocolError(f"{peer}: message of {n} B exceeds {max_bytes} B")
    return n


def decode(body: bytes, peer: str) -> dict:
    """A frame's body as the JSON object it must hold (else ``ProtocolError``)."""
    try:
        msg = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"{peer}: message is not JSON") from e
    if not isinstance(msg, dict):
        raise ProtocolError(f"{peer}: message is a JSON {type(msg).__name__}, expected an "
                            f"object")
    return msg


def send_msg(sock: socket.socket, msg: dict) -> None:
    frame = encode(msg)
    try:
        sock.sendall(frame)
    except socket.timeout as e:
        raise TransferTimeout(f"sending {len(frame) - HEADER.size} B: peer not reading within "
                              f"{sock.gettimeout()} s") from e


def recv_msg(sock: socket.socket, peer: str, max_bytes: int = MAX_MESSAGE,
             frame_s: float = 30.0) -> dict:
    """One message (a JSON object); see the module docstring for the deadlines."""
    n = body_length(_recv_exact(sock, HEADER.size, peer, None, frame_s), peer, max_bytes)
    return decode(_recv_exact(sock, n, peer, time.monotonic() + frame_s, frame_s), peer)


async def read_frame(reader, peer: str = "peer", max_bytes: int = MAX_MESSAGE) -> dict:
    """``recv_msg`` on an ``asyncio.StreamReader`` (the router's side; its deadlines are the
    caller's ``asyncio.wait_for``)."""
    try:
        n = body_length(await reader.readexactly(HEADER.size), peer, max_bytes)
        body = await reader.readexactly(n)
    except EOFError as e:                       # asyncio.IncompleteReadError
        raise PeerLost(f"{peer}: connection closed by the peer") from e
    return decode(body, peer)


def write_frame(writer, msg: dict) -> None:
    """``send_msg`` on an ``asyncio.StreamWriter`` (buffered; the caller drains)."""
    writer.write(encode(msg))


def _recv_exact(sock: socket.socket, n: int, peer: str, deadline: float | None,
                frame_s: float) -> bytes:
    """``n`` bytes. Without a ``deadline`` the first byte may take the socket's timeout
    (``NoMessage``), and the rest then has ``frame_s``."""
    idle = sock.gettimeout()
    buf = bytearray()
    try:
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"{peer}: a message stalled: {len(buf)} of {n} B "
                                          f"arrived within {frame_s} s")
                sock.settimeout(left if idle is None else min(left, max(idle, 0.05)))
            try:
                chunk = sock.recv(n - len(buf))
            except socket.timeout as e:
                if deadline is None:
                    raise NoMessage(f"{peer}: no answer within {idle} s") from e
                continue
            except OSError as e:
                raise PeerLost(f"{peer}: connection lost ({e})") from e
            if not chunk:
                raise PeerLost(f"{peer}: connection closed by the peer")
            buf += chunk
            if deadline is None:
                deadline = time.monotonic() + frame_s
    finally:
        sock.settimeout(idle)
    return bytes(buf)


def error_reply(e: Exception) -> dict:
    """The answer to a request that failed with ``e``."""
    name = type(e).__name__ if type(e).__name__ in ERRORS else "ProtocolError"
    return {"ok": False, "error": name, "message": str(e)}


def raise_for_reply(reply: dict, what: str) -> dict:
    """``reply`` if it says ok, else its error raised as the class it names."""
    if not reply.get("ok"):
        cls = ERRORS.get(reply.get("error"), ProtocolError)
        raise cls(str(reply.get("message", f"{what} failed")))
    return reply


def mac_context(request_id: str, reply: dict) -> str:
    """What each MAC of a pull's answer is bound to besides its segment index."""
    return f"{request_id}|{reply['nonce']}|{reply['nbytes']}|{reply['segment_bytes']}"


def segment_macs(data: np.ndarray, segment_bytes: int, key: bytes, context: str) -> list[str]:
    """HMAC-SHA256 of each ``segment_bytes`` slice of a payload (the sender's side)."""
    starts = range(0, data.size, segment_bytes)
    return _each(lambda i: _mac_hex(key, context, i // segment_bytes,
                                    [data[i:i + segment_bytes]]), starts)


def received_macs(plan: TransferPlan, regions, nbytes: int, segment_bytes: int, key: bytes,
                  context: str) -> list[str]:
    """The same MACs over the bytes as they landed: the plan's writes read back in payload
    order from the (host) destination regions; ``plan.src_offset`` is relative to the payload."""
    pieces: list[list] = [[] for _ in range(-(-nbytes // segment_bytes))]
    covered = 0
    for i in np.argsort(plan.src_offset, kind="stable"):
        s, n = int(plan.src_offset[i]), int(plan.nbytes[i])
        if s != covered:
            raise ProtocolError(f"plan {plan.kind!r}: payload bytes [{covered}, {s}) are "
                                f"not written, so they cannot be checked")
        address = regions[plan.dst_region[i]].address + int(plan.dst_offset[i])
        piece = memoryview((ctypes.c_uint8 * n).from_address(address)).cast("B")
        while piece:
            seg = s // segment_bytes
            take = min(len(piece), (seg + 1) * segment_bytes - s)
            pieces[seg].append(piece[:take])
            piece, s = piece[take:], s + take
        covered = s
    return _each(lambda seg: _mac_hex(key, context, seg, pieces[seg]), range(len(pieces)))


def _mac_hex(key: bytes, context: str, index: int, pieces) -> str:
    m = hmac.new(key, f"{context}|{index}".encode(), hashlib.sha256)
    for piece in pieces:
        m.update(piece)
    return m.hexdigest()


def _each(fn, items) -> list:
    """``[fn(x) for x in items]``, on every core (hashing releases the GIL)."""
    items = list(items)
    if len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(len(items), os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, items))


def verify_macs(got: list[str], sent: list, request_id: str, segment_bytes: int) -> None:
    """Raise ``ChecksumMismatch`` naming the first segment whose MAC differs."""
    if not isinstance(sent, list) or len(sent) != len(got):
        raise ChecksumMismatch(f"request {request_id!r}: the prefill side sent "
                               f"{len(sent) if isinstance(sent, list) else sent!r} MACs for "
                               f"{len(got)} segments")
    bad = [i for i, (a, b) in enumerate(zip(got, sent))
           if not (isinstance(b, str) and hmac.compare_digest(a, b))]
    if bad:
        raise ChecksumMismatch(f"request {request_id!r}: {len(bad)} of {len(got)} segments "
                               f"differ, first segment {bad[0]} (payload bytes from "
                               f"{bad[0] * segment_bytes})")
