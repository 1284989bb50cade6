"""A TCP proxy between two of the system's processes, that a test can hold and release.

`TcpProxy(target)` listens on a free port of 127.0.0.1 and forwards every
connection to `target` byte for byte (TLS passes through untouched: the client
still talks to the server's certificate). `hold()` stops forwarding, in both
directions or in one (`upstream`: from the client to the server, `downstream`:
back): whatever a held side sends from then on stays in the proxy and the
sockets' buffers, connection closes included, and the connections stay open, so
the other side sees nothing but silence. `release()` forwards what was held, in
order, and goes on forwarding.

A test puts one between a replica and the scheduler to arrange what a race would
otherwise decide: held, the replica's heartbeats and reports stop arriving (the
scheduler lets its lease run out and moves its jobs) while the replica itself still
sees its stream up; released, what the replica sent meanwhile arrives late.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from services.launcher.ports import free_port

CHUNK = 65536


class TcpProxy:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.address = f"127.0.0.1:{free_port()}"
        self._listener = socket.create_server(("127.0.0.1", int(self.address.split(":")[1])))
        self._gate = threading.Condition()
        # Held directions: True is upstream (client to server), False downstream.
        self._held: set[bool] = set()
        # Sends under way: `hold` returns once none is, so nothing passes after it.
        self._sending = 0
        # Chunks read and kept at the gate while held (one per direction at most).
        self.waiting = 0
        self._closed = False
        self._sockets: list[socket.socket] = []
        self.connections = 0
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._acceptor.start()

    def hold(self, upstream: bool = True, downstream: bool = True) -> None:
        """Stops forwarding in those directions; returns once nothing more can pass in
        them until `release`."""
        with self._gate:
            self._held |= {d for d, held in ((True, upstream), (False, downstream)) if held}
            while self._sending:
                self._gate.wait()

    def release(self) -> None:
        """Forwards what was held, in order, and goes on forwarding both ways."""
        with self._gate:
            self._held.clear()
            self._gate.notify_all()

    def close(self) -> None:
        with self._gate:
            self._closed = True
            self._held.clear()
            self._gate.notify_all()
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        self._acceptor.join(5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._gate:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
                self.connections += 1
            for source, sink, upstream in ((client, server, True), (server, client, False)):
                threading.Thread(
                    target=self._pump,
                    args=(source, sink, upstream),
                    name="proxy-pump",
                    daemon=True,
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        """Forwards one direction until either side closes; an end is forwarded as one."""
        try:
            while True:
                data = source.recv(CHUNK)
                if not self._forward(sink, data, upstream):
                    return
                if not data:
                    return
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.close()

    def _forward(self, sink: socket.socket, data: bytes, upstream: bool) -> bool:
        """Sends `data` (an empty one: the end of this direction) once not held."""
        with self._gate:
            if upstream in self._held:
                self.waiting += 1
                while upstream in self._held and not self._closed:
                    self._gate.wait()
                self.waiting -= 1
            if self._closed:
                return False
            self._sending += 1
        try:
            if data:
                sink.sendall(data)
            else:
                sink.shutdown(socket.SHUT_WR)
        finally:
            with self._gate:
                self._sending -= 1
                self._gate.notify_all()
        return True
