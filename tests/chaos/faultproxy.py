"""A TCP proxy that can partition its clients from the server, the way a cut link does.

`cut()` stops moving bytes in both directions without closing anything: the clients' writes
sit in socket buffers, their reads wait, their timeouts fire, and new connections are
accepted but never served, just as packets vanish on a dead link. `heal()` lets the held
bytes flow again, as TCP's retransmissions would. Clients that gave up meanwhile closed
their sockets; those connections end when the proxy sees the close.
"""

from __future__ import annotations

import socket
import threading

from services.procs import free_port


class FaultProxy:
    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.port = free_port()
        self.host = listen_host
        self._open = threading.Event()
        self._open.set()
        self._closing = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server = socket.create_server((listen_host, self.port))
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closing = True
        self._open.set()
        self._server.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self._open.wait()  # a connection opened during the cut is never served until it heals
        try:
            server = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        with self._lock:
            self._socks += [client, server]
        threading.Thread(target=self._pump, args=(server, client), daemon=True).start()
        self._pump(client, server)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self._open.wait()
                data = src.recv(65536)
                if not data:
                    break
                self._open.wait()  # bytes read as the link went down are held, not lost
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
