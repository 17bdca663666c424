"""The serving process's end of a model process's pipe on the event loop: whole messages, never blocking.

The model process reads and writes its end of the duplex ``multiprocessing`` pipe with the blocking
``Connection.recv_bytes`` / ``send_bytes``. The serving process must not block its event loop on the
pipe, and it cannot use those calls once the loop watches the descriptor: libuv (uvloop, which
uvicorn runs) puts a polled descriptor in non-blocking mode, so a ``send_bytes`` larger than the
socket's buffer (~208 KiB) raised ``BlockingIOError`` halfway through a message, and a
``recv_bytes`` of an answer still arriving would too. :class:`PipeEnd` instead writes and reads the
same frames (``Connection``'s: a big-endian int32 length, or -1 and a uint64 length for messages of
2 GiB and more, then the bytes) in non-blocking mode on either event loop: what does not fit now
is written when the loop says the pipe is writable (``loop.add_writer``), bytes read are kept
until their message is whole.
"""

from __future__ import annotations

import asyncio
import collections
import os
import struct
from collections.abc import Callable

_LEN = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_READ = 1 << 20  # bytes per os.read


def frame(message: bytes) -> list[bytes]:
    """``message`` framed as ``multiprocessing.connection.Connection.send_bytes`` frames it."""
    n = len(message)
    if n > 0x7FFFFFFF:
        return [_LEN.pack(-1), _LONG.pack(n), message]
    return [_LEN.pack(n), message]


def split_frames(buf: bytearray) -> list[bytes]:
    """The whole messages at the start of ``buf`` (removed from it); a partial one stays."""
    out = []
    while len(buf) >= _LEN.size:
        (n,) = _LEN.unpack_from(buf, 0)
        start = _LEN.size
        if n == -1:
            if len(buf) < _LEN.size + _LONG.size:
                break
            (n,) = _LONG.unpack_from(buf, _LEN.size)
            start += _LONG.size
        if len(buf) < start + n:
            break
        out.append(bytes(buf[start : start + n]))
        del buf[: start + n]
    return out


class PipeEnd:
    """One pipe end (``conn``, a ``multiprocessing`` Connection) on an event loop.

    ``on_message(bytes)`` gets each whole message read, in order; ``on_closed()`` once, when the
    other end is gone (end of file, or an error other than "would block"). :meth:`send` queues
    a message and writes what the pipe takes now. Between :meth:`attach` and :meth:`detach` the
    descriptor is non-blocking; detached, it is blocking again (``Connection`` calls work).
    """

    def __init__(self, conn, on_message: Callable[[bytes], None], on_closed: Callable[[], None]) -> None:
        self.fd = conn.fileno()
        self.on_message, self.on_closed = on_message, on_closed
        self.loop: asyncio.AbstractEventLoop | None = None
        self.out: collections.deque[memoryview] = collections.deque()
        self.inbuf = bytearray()
        self.writing = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.loop is loop:
            return
        self.detach()
        os.set_blocking(self.fd, False)
        self.loop = loop
        loop.add_reader(self.fd, self._readable)

    def detach(self) -> None:
        """Stop watching the pipe (unsent bytes are dropped) and make it blocking again."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
            if self.writing:
                self.loop.remove_writer(self.fd)
        self.loop, self.writing = None, False
        self.out.clear()
        try:
            os.set_blocking(self.fd, True)
        except OSError:  # already closed
            pass

    def send(self, message: bytes) -> None:
        """Queue ``message`` (attached only) and write what the pipe takes now."""
        self.out.extend(memoryview(b) for b in frame(message))
        if not self.writing:
            self._flush()

    def _flush(self) -> None:
        try:
            while self.out:
                head = self.out[0]
                n = os.write(self.fd, head)
                if n < len(head):
                    self.out[0] = head[n:]
                else:
                    self.out.popleft()
        except BlockingIOError:
            if not self.writing:
                self.writing = True
                self.loop.add_writer(self.fd, self._flush)
            return
        except OSError:
            self._closed()
            return
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)

    def _readable(self) -> None:
        ended = False
        try:
            while True:
                chunk = os.read(self.fd, _READ)
                if not chunk:
                    ended = True
                    break
                self.inbuf += chunk
                if len(chunk) < _READ:
                    break
        except BlockingIOError:
            pass
        except OSError:
            ended = True
        for message in split_frames(self.inbuf):  # what arrived whole before an end is still answered
            self.on_message(message)
        if ended and self.loop is not None:
            self._closed()

    def _closed(self) -> None:
        self.detach()
        self.on_closed()


__all__ = ["PipeEnd", "frame", "split_frames"]
