"""The control wire of ``hardware.protocol``: message framing, error answers, payload checksums.

A message is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (at most
``MAX_MESSAGE``). A failed request is answered ``{"ok": false, "error": NAME, "message": ...}``
where ``NAME`` is one of ``ERRORS`` (anything else is sent as ``ProtocolError``); the other
side raises the same class again (``raise_for_reply``). Payload checksums are CRC32 per
``segment_bytes`` slice of the prepared bytes, computed by the sender over its payload
(``segment_crcs``) and by the receiver over the bytes as they landed (``received_crcs``).

Reading raises only the transport's own exceptions: ``PeerLost`` on EOF or reset,
``TransferTimeout`` when no message starts within the socket's timeout, ``ProtocolError`` for
an oversized or non-JSON message.
"""

from __future__ import annotations

import json
import socket
import struct
import zlib

import numpy as np

from hardware.plan import TransferPlan
from hardware.transport.base import (
    AuthError, PeerLost, ProtocolError, SendBufferExhausted, TransferTimeout, UnknownRequest,
)

MAX_MESSAGE = 64 << 20
ERRORS = {cls.__name__: cls for cls in (AuthError, UnknownRequest, SendBufferExhausted,
                                        ProtocolError)}


def send_msg(sock: socket.socket, msg: dict) -> None:
    body = json.dumps(msg).encode()
    sock.sendall(struct.pack("!I", len(body)) + body)


def recv_msg(sock: socket.socket, peer: str) -> dict:
    """One message; ``PeerLost`` on EOF or reset, ``TransferTimeout`` on the socket timeout."""
    (n,) = struct.unpack("!I", _recv_exact(sock, 4, peer))
    if n > MAX_MESSAGE:
        raise ProtocolError(f"{peer}: message of {n} B exceeds {MAX_MESSAGE} B")
    try:
        return json.loads(_recv_exact(sock, n, peer, may_time_out=False))
    except ValueError as e:
        raise ProtocolError(f"{peer}: message is not JSON") from e


def _recv_exact(sock: socket.socket, n: int, peer: str, may_time_out: bool = True) -> bytes:
    """``n`` bytes; a timeout is raised only before the first byte of a message, so that a
    message is never half read."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout as e:
            if may_time_out and not buf:
                raise TransferTimeout(f"{peer}: no answer within {sock.gettimeout()} s") from e
            continue
        except OSError as e:
            raise PeerLost(f"{peer}: connection lost ({e})") from e
        if not chunk:
            raise PeerLost(f"{peer}: connection closed by the peer")
        buf += chunk
    return bytes(buf)


def error_reply(e: Exception) -> dict:
    """The answer to a request that failed with ``e``."""
    name = type(e).__name__ if type(e).__name__ in ERRORS else "ProtocolError"
    return {"ok": False, "error": name, "message": str(e)}


def raise_for_reply(reply: dict, what: str) -> dict:
    """``reply`` if it says ok, else its error raised as the class it names."""
    if not reply.get("ok"):
        cls = ERRORS.get(reply.get("error"), ProtocolError)
        raise cls(reply.get("message", f"{what} failed"))
    return reply


def segment_crcs(data: np.ndarray, segment_bytes: int) -> list[int]:
    """CRC32 of each ``segment_bytes`` slice of a payload (the sender's side)."""
    return [zlib.crc32(data[i:i + segment_bytes]) for i in range(0, data.size, segment_bytes)]


def received_crcs(plan: TransferPlan, regions, nbytes: int, segment_bytes: int) -> list[int]:
    """The same CRCs over the bytes as they landed: the plan's writes read back in payload
    order from the (host) destination regions; ``plan.src_offset`` is relative to the payload."""
    import ctypes

    crcs = [0] * -(-nbytes // segment_bytes)
    covered = 0
    for i in np.argsort(plan.src_offset, kind="stable"):
        s, n = int(plan.src_offset[i]), int(plan.nbytes[i])
        if s != covered:
            raise ProtocolError(f"plan {plan.kind!r}: payload bytes [{covered}, {s}) are "
                                f"not written, so they cannot be checked")
        piece = ctypes.string_at(regions[plan.dst_region[i]].address + int(plan.dst_offset[i]),
                                 n)
        while piece:
            seg = s // segment_bytes
            take = min(len(piece), (seg + 1) * segment_bytes - s)
            crcs[seg] = zlib.crc32(piece[:take], crcs[seg])
            piece, s = piece[take:], s + take
        covered = s
    return crcs
