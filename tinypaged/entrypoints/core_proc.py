"""The engine core's child process and the two ZeroMQ sockets to it: the process side of ``CoreClient``.

vLLM v1 splits its multi-process client the same way: ``CoreEngineProcManager`` (``v1/engine/utils.py``) starts and
ends the core processes, and ``MPClient``'s ``BackgroundResources`` holds the ZeroMQ context and sockets and closes
them. Here:

* ``CoreChannel`` (the wire) owns the ZeroMQ context, the PUSH socket to the core and the PULL socket from it, their
  private folder, and the msgspec-MessagePack encoder and decoder (``engine_core.py``'s ``ToCore`` / ``FromCore``).
  A ZeroMQ socket is not thread-safe: its owner serializes the sends (``CoreClient`` under its request table's lock)
  and reads from one thread at a time (``CoreClient.start``, then its reader thread).
* ``CoreProcess`` (the lifecycle) owns the child process running ``engine_core.py``: ``start`` spawns it and waits
  for ``Ready``; ``shutdown`` asks it to go and kills it if it does not. No orphan: a failed or interrupted start
  (Ctrl-C while the model loads, included) leaves no process, and the core exits by itself when its parent does
  (``PR_SET_PDEATHSIG``; a parent-pid check elsewhere).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import msgspec

from tinypaged.entrypoints import engine_core as msg

SOCKET_DIR_PREFIX = "tinypaged-core-"  # + the server's pid + "-" + random: the ipc sockets' private folder


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_socket_dirs(root: str | None = None) -> list[str]:
    """Remove the socket folders (``tinypaged-core-<pid>-*`` in the temporary folder) of servers that were killed
    outright (SIGKILL leaves them): only this user's, and only those whose owner pid is dead. Returns them."""
    import re
    import shutil

    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = re.fullmatch(re.escape(SOCKET_DIR_PREFIX) + r"(\d+)-[\w]+", name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        import stat

        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or _pid_alive(int(m.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class CoreChannel:
    """The two sockets to one engine core, and the wire format (see the module docstring for who may use them).

    ``bind`` makes them: ``ipc://`` in a private folder (mode 0700, named after this process so that a later server
    can tell a dead one's and remove it) or ``tcp://127.0.0.1`` on Windows; ``close`` ends them and removes the
    folder, once (a second call does nothing)."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(msg.FromCore)
        self.to_core = self.from_core = None  # the PUSH and PULL sockets, once bound
        self._ctx = None
        self._dir = None

    def bind(self) -> tuple[str, str]:
        """Make and bind both sockets; returns their addresses (to the core, from the core)."""
        import zmq

        self._ctx = zmq.Context()
        self.to_core = self._ctx.socket(zmq.PUSH)
        self.from_core = self._ctx.socket(zmq.PULL)
        self.to_core.setsockopt(zmq.LINGER, 0)
        self.from_core.setsockopt(zmq.LINGER, 0)
        self._dir = None
        if sys.platform == "win32":
            in_addr = f"tcp://127.0.0.1:{self.to_core.bind_to_random_port('tcp://127.0.0.1')}"
            out_addr = f"tcp://127.0.0.1:{self.from_core.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            remove_stale_socket_dirs()
            # mode 0700: ours alone; the name holds this process's id, so a later server can tell a dead one's
            self._dir = tempfile.TemporaryDirectory(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
            in_addr, out_addr = f"ipc://{self._dir.name}/in", f"ipc://{self._dir.name}/out"
            self.to_core.bind(in_addr)
            self.from_core.bind(out_addr)
        return in_addr, out_addr

    def encode(self, message) -> bytes:
        """A message as its wire bytes (an integer beyond 64 bits raises OverflowError)."""
        return self._encoder.encode(message)

    def send(self, message) -> None:
        """Encode and send one message to the core (the caller serializes sends)."""
        self.send_bytes(self._encoder.encode(message))

    def send_bytes(self, data: bytes) -> None:
        self.to_core.send(data, copy=False)

    def receive(self, timeout_ms: int):
        """The core's next message, or None if none came within ``timeout_ms``."""
        if self.from_core.poll(timeout_ms):
            return self._decoder.decode(self.from_core.recv())
        return None

    def close(self) -> None:
        if self._ctx is None or self._ctx.closed:
            return
        for sock in (self.to_core, self.from_core):
            sock.close(linger=0)
        self._ctx.term()
        if self._dir is not None:
            self._dir.cleanup()


class CoreProcess:
    """The engine core's child process (``python -m tinypaged.entrypoints.engine_core CONFIG_JSON``).

    Owns ``proc`` from ``start`` on; nothing else spawns, waits for or kills it. After a ``start`` that raised, or
    after ``shutdown``, the process has exited (asked, then killed after a grace period)."""

    def __init__(self, args: dict, startup_timeout: float = 900.0):
        self.args, self.startup_timeout = args, startup_timeout  # args: serve's, as JSON values (cli_args.core_args)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def poll(self) -> int | None:
        """The exit status once the process has ended, else None."""
        return self.proc.poll()

    def start(self, channel: CoreChannel, in_addr: str, out_addr: str) -> msg.Ready:
        """Spawn the core on the channel's addresses and wait for its first message: ``Ready`` is returned; a bad
        knob or model (``StartupFailed``) is a ValueError with the engine's message, anything else a RuntimeError.
        If it raises (Ctrl-C while the model loads, too), the process has exited."""
        config = {"args": self.args, "input": in_addr, "output": out_addr, "parent_pid": os.getpid()}
        self.proc = subprocess.Popen([sys.executable, "-m", "tinypaged.entrypoints.engine_core", json.dumps(config)])
        deadline = time.monotonic() + self.startup_timeout
        try:
            while True:
                first = channel.receive(100)
                if first is not None:
                    break
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the engine core process exited with {self.proc.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine core did not start within {self.startup_timeout:.0f} s")
        except BaseException:  # Ctrl-C while the model loads, too: no engine core is left behind
            self.kill()
            raise
        if isinstance(first, msg.StartupFailed):
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
            if first.kind in ("ValueError", "TypeError", "NotImplementedError", "FileNotFoundError"):
                raise ValueError(first.message)  # the knob's own message (serve prints it, exits 2)
            raise RuntimeError(f"the engine core failed to start: {first.kind}: {first.message}")
        return first

    def shutdown(self, ask) -> None:
        """``ask()`` (send ``Shutdown``: the core ends what is left), wait up to 10 s, then kill."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            ask()
        except Exception:  # noqa: BLE001 - the socket is closing: kill below
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
