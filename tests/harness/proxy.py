"""A TCP proxy on 127.0.0.1 that can cut one host off from PostgreSQL (a network partition).

The test beds share the machine's network namespace, so a firewall cannot isolate one of them. The
host to be cut off gets its own way to the database instead: its DSN names this proxy's port, and
the test switches the proxy between three modes at any time:

- `forward()` / `heal()`: bytes flow both ways; new connections are forwarded to the target.
  Connections that were black-holed are closed (with a reset), because their streams have lost bytes
  and cannot be resumed: the client sees an error and reconnects.
- `cut("reset")`: every open connection is reset (SO_LINGER 0, an RST) on both sides, and every new
  connection is accepted and reset at once. The client learns of the cut immediately.
- `cut("blackhole")`: open connections stay open but every byte in either direction is read and
  dropped; new connections are accepted and their bytes dropped too. Nothing ever answers.

A limit of the black hole, by construction: the proxy's own kernel still ACKs every segment, so TCP
keepalives and TCP_USER_TIMEOUT on the client do NOT detect it (on a real partition they would).
Only application-level timeouts (a deadline on a statement, on a connect, on a heartbeat) detect it.
A client that survives this black hole also survives a real one; the converse is not true.

The proxy runs its own asyncio loop in a daemon thread and only ever connects to the one target it
was given. Nothing raised in that thread leaks out; unexpected errors are kept in `.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, Literal

BUFFER = 65536
CONNECT_TIMEOUT = 10.0
_LINGER_RST = struct.pack("ii", 1, 0)  # l_onoff=1, l_linger=0: close() sends an RST, not a FIN

Mode = Literal["forward", "reset", "blackhole"]


def _close(sock: socket.socket | None, rst: bool) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    with contextlib.suppress(OSError):
        sock.close()


class _Connection:
    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.blackholed = False
        self.rst = False  # close both sides with an RST rather than a FIN
        self.task: asyncio.Task[None] | None = None


class Proxy:
    """`Proxy(target_port=postgres.port)`; its clients connect to 127.0.0.1:`.port`."""

    def __init__(self, target_host: str = "127.0.0.1", target_port: int = 5432) -> None:
        if not 0 < target_port < 65536:
            raise ValueError(f"bad target port {target_port}")
        self.target = (target_host, target_port)
        self.errors: list[str] = []
        self._mode: Mode = "forward"
        self._conns: set[_Connection] = set()
        self._closed = False
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._on_loop_error)
        self._thread = threading.Thread(target=self._run_loop, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()
        self._serve_task: Future[None] = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)

    # -- the test thread's side -------------------------------------------------------------------

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def connections(self) -> int:
        """Client connections open now (forwarded or black-holed)."""
        return len(self._conns)

    def dsn(self, dbname: str = "postgres", user: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={user} dbname={dbname}"

    def forward(self) -> None:
        """Forward new connections; close the black-holed ones (their streams are corrupt)."""
        self._call(self._set_mode, "forward")

    heal = forward

    def cut(self, how: Literal["reset", "blackhole"]) -> None:
        """Cut the host off; when this returns, the open connections are already reset or black-holed."""
        if how not in ("reset", "blackhole"):
            raise ValueError(f"cut how? {how!r} (reset or blackhole)")
        self._call(self._set_mode, how)

    def close(self) -> None:
        """Close every connection and the listener, stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread.is_alive():
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
        finally:
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()
            _close(self._listener, rst=False)

    def _call(self, method: Callable[[Mode], Coroutine[Any, Any, None]], mode: Mode) -> None:
        if self._closed:
            raise RuntimeError("the proxy is closed")
        asyncio.run_coroutine_threadsafe(method(mode), self._loop).result(timeout=30)

    # -- the loop's side --------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        self.errors.append(f"{context.get('message')}: {exc!r}" if exc else str(context.get("message")))

    async def _set_mode(self, mode: Mode) -> None:
        self._mode = mode
        doomed = []
        for conn in list(self._conns):
            if mode == "reset" or (mode == "forward" and conn.blackholed):
                doomed.append(conn)
            elif mode == "blackhole":
                conn.blackholed = True
        await self._abort(doomed)

    async def _abort(self, conns: list[_Connection]) -> None:
        tasks = []
        for conn in conns:
            conn.rst = True
            if conn.task is not None:
                conn.task.cancel()
                tasks.append(conn.task)
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    async def _shutdown(self) -> None:
        self._serve_task.cancel()  # the listener closes once the loop has stopped
        await self._abort(list(self._conns))

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(self._listener)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # EMFILE and the like: do not spin, do not die
                self.errors.append(f"accept: {exc!r}")
                await asyncio.sleep(0.1)
                continue
            client.setblocking(False)
            if self._mode == "reset":
                _close(client, rst=True)
                continue
            conn = _Connection(client)
            self._conns.add(conn)
            conn.task = loop.create_task(self._handle(conn))

    async def _handle(self, conn: _Connection) -> None:
        loop = asyncio.get_running_loop()
        pumps: list[asyncio.Task[None]] = []
        try:
            if self._mode == "blackhole":
                conn.blackholed = True
                await self._pump(conn, conn.client, None, from_client=True)
                return
            conn.upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            conn.upstream.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(conn.upstream, self.target), CONNECT_TIMEOUT)
            except OSError:  # refused, unreachable, or TimeoutError (an OSError too)
                conn.rst = True  # the target is down: the client sees a reset, as a refused connect
                return
            pumps = [loop.create_task(self._pump(conn, conn.client, conn.upstream, from_client=True)),
                     loop.create_task(self._pump(conn, conn.upstream, conn.client, from_client=False))]
            await asyncio.wait(pumps)
        except asyncio.CancelledError:
            pass  # aborted by a mode change or by close(); conn.rst says how to close
        except Exception as exc:  # nothing may leak from the proxy's thread
            self.errors.append(f"connection: {exc!r}")
            conn.rst = True
        finally:
            for pump in pumps:
                pump.cancel()
            if pumps:
                # The pumps' socket readers are unregistered once they have finished; only then may
                # the sockets close (a closed fd number may be reused by the next accepted socket).
                await asyncio.gather(*pumps, return_exceptions=True)
            _close(conn.client, conn.rst)
            _close(conn.upstream, conn.rst)
            self._conns.discard(conn)

    async def _pump(self, conn: _Connection, src: socket.socket, dst: socket.socket | None,
                    from_client: bool) -> None:
        """Copy src to dst until EOF; drop the bytes while the connection is black-holed. An error
        on either side resets the whole connection, as a broken path would."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await loop.sock_recv(src, BUFFER)
                if not data:
                    break
                if conn.blackholed or dst is None:
                    continue
                await loop.sock_sendall(dst, data)
        except OSError:
            if conn.blackholed and not from_client:
                return  # the server's side broke while cut off: the client must not learn of it
            conn.rst = True
            if conn.task is not None:
                conn.task.cancel()
            return
        # EOF from src
        if conn.blackholed:
            if from_client:  # the client hung up: nothing left to hold open
                if conn.task is not None:
                    conn.task.cancel()
            return  # the server hung up while cut off: the client must not learn of it
        if dst is not None:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)  # pass the FIN on; the other direction may still flow
