"""Messages over a local stream socket: each one a pickle behind its 4-byte length.

Both ends are this package's own processes (the API server and the engine core it started), so pickle's
trust model holds and its speed is the point: a step's message for 8 sequences is a few hundred bytes and
a few microseconds. Sends take a lock (several threads of a process may send); a receive is one ``recv``
returning every message it completed. The socket may be non-blocking (the event loop's reader: libuv and
so uvloop may report a socket readable when it is not, and a blocking ``recv`` there waited for the next
step, 140 us a step); a send then waits for room, a receive returns what there is.
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
import threading
from typing import Any

_HEADER = struct.Struct("<I")
RECV_BYTES = 1 << 18


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()
        self._waiting: list[Any] = []
        # Received into one buffer made once: ``recv(n)`` allocates n bytes per call, and at 256 KiB that is a
        # fresh mapping (and its page faults) per message, which cost the event loop 100 us per step.
        self._chunk = bytearray(RECV_BYTES)
        self._view = memoryview(self._chunk)
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any) -> None:
        """Raises OSError (BrokenPipeError, ConnectionResetError) when the other end is gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(_HEADER.pack(len(data)) + data)
        with self._send_lock:
            while view:
                try:
                    sent = self.sock.send(view)
                except BlockingIOError:  # a non-blocking socket whose buffer is full: wait for room
                    select.select([], [self.sock], [])
                    continue
                view = view[sent:]

    def receive(self) -> list[Any]:
        """One ``recv``: the messages it completes (maybe none). EOFError once the other end has closed."""
        if self._waiting:
            messages, self._waiting = self._waiting, []
            return messages
        messages = []
        try:
            received = self.sock.recv_into(self._chunk)
        except BlockingIOError:  # woken for nothing (a non-blocking socket)
            return messages
        if not received:
            raise EOFError("the other end closed the channel")
        self._buffer += self._view[:received]
        buffer, at = self._buffer, 0
        while len(buffer) - at >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, at)
            if len(buffer) - at - _HEADER.size < size:
                break
            start = at + _HEADER.size
            messages.append(pickle.loads(buffer[start : start + size]))
            at = start + size
        del buffer[:at]
        return messages

    def receive_one(self) -> Any:
        """Block until a message arrives; messages that came with it wait for the next ``receive``."""
        while not self._waiting:
            self._waiting = self.receive()
        return self._waiting.pop(0)

    def close(self) -> None:
        self.sock.close()
