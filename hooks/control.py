"""The control channel inside a dormant server's process: arm and disarm its hooks while it
serves (`hstrace arm SERVER` / `hstrace disarm SERVER`; the client is
`hstrace.engines.control`, the wire protocol `hstrace.engines.protocol`).

Started by an engine's `install` when the record config says `dormant` and names a `control`
run directory: one daemon thread per process listens on `<run dir>/<pid>.sock`. Never a network
port; the run dir is created 0700 (refused if it belongs to another user or is open to others),
the socket is chmod 0600, and each peer's uid is read from the kernel (SO_PEERCRED): only the
server's own user, or root, may arm or disarm it.

One session at a time. The connection that armed it is its lease: when it closes (the client
disarmed, exited, or died) the process disarms; `duration` is enforced here too (a timer), and
`requests` by the recorder's step taps (`Recorder.step_requests`), so a server whose client
never disarms stops at the limit given. Each process disarms on its own (the trace's rank
groups are closed by their writers); the lease holder is told `{"event": "disarmed"}`.

Processes forked from a hooked one (vLLM's workers under fork) start their own listener.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import sys
import threading
from pathlib import Path
from typing import Any

from hstrace.hooks.common import Recorder

from hstrace.engines.protocol import SOCKET_SUFFIX


class Channel:
    """One process's listener and its session (the lease connection, the duration timer)."""

    def __init__(self, rec: Recorder, engine: str, run_dir: Path) -> None:
        self.rec, self.engine, self.run_dir = rec, engine, run_dir
        self.pid = os.getpid()
        self.path = run_dir / f"{self.pid}{SOCKET_SUFFIX}"
        self.lock = threading.Lock()  # the session's state below
        self.lease: Any = None  # the arming connection's file
        self.timer: threading.Timer | None = None
        self.server: socket.socket | None = None

    # ---- listening -------------------------------------------------------------------------

    def start(self) -> None:
        _private_dir(self.run_dir)
        self.path.unlink(missing_ok=True)  # a socket left by a dead process with this pid
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.path))  # inside a 0700 dir: no one else can reach it meanwhile
        os.chmod(self.path, 0o600)
        server.listen(8)
        self.server = server
        rec = self.rec
        rec.on_limit = self.end
        threading.Thread(target=self._accept, name="hstrace-control", daemon=True).start()
        import atexit

        atexit.register(self._unlink)

    def _unlink(self) -> None:
        if os.getpid() == self.pid:  # never a forked child removing its parent's socket
            self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        server = self.server
        while server is not None:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn,), name="hstrace-control-conn", daemon=True
            ).start()

    # ---- one connection ----------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if not _peer_allowed(conn):
                return
            fh = conn.makefile("rwb", buffering=0)
            try:
                for line in fh:
                    reply = self._command(json.loads(line), fh)
                    _send(fh, reply)
            except (OSError, ValueError):
                pass
            finally:
                if self.lease is fh:  # the client closed or died: the session ends
                    self.end("lease_closed")

    def _command(self, msg: dict[str, Any], fh: Any) -> dict[str, Any]:
        cmd = msg.get("cmd")
        rec = self.rec
        if cmd == "hello":
            return {
                "pid": self.pid,
                "engine": self.engine,
                "version": ".".join(map(str, rec.version)),
                # a session still closing counts: its trace is not finished yet
                "armed": rec.armed or rec.session_open or rec.closing,
                # which process this is (SGLang names its scheduler / detokenizer processes)
                # and the load-time audit it keeps for the next session's trace
                "title": _title(),
                "audit": sorted(rec.kept_static),
            }
        if cmd == "disarm":
            return {"pid": self.pid, "disarmed": self.end("disarm")}
        if cmd != "arm":
            return {"pid": self.pid, "error": f"unknown command {cmd!r}"}
        with self.lock:
            if self.lease is not None or rec.armed:
                return {"pid": self.pid, "error": "already armed by another client"}
            try:
                info = rec.arm(msg)
            except Exception as exc:  # the client says it; serving goes on dormant
                return {"pid": self.pid, "error": f"{type(exc).__name__}: {exc}"}
            self.lease = fh
            duration = msg.get("duration")
            if duration is not None:
                self.timer = threading.Timer(float(duration), self.end, ("duration",))
                self.timer.daemon = True
                self.timer.start()
        return {"pid": self.pid, "armed": True, **info}

    def end(self, reason: str) -> bool:
        """End the session (any thread but the serving one: the writer's close flushes). The
        lease holder is told once the trace is closed. False when none was armed."""
        with self.lock:
            lease, self.lease = self.lease, None
            timer, self.timer = self.timer, None
            if timer is not None:
                timer.cancel()
            try:
                ended = self.rec.disarm()
            except Exception as exc:  # a failed close is said to the client, never raised here
                print(f"hstrace: disarm: {type(exc).__name__}: {exc}", file=sys.stderr)
                ended = True
            if lease is not None:
                try:
                    _send(lease, {"event": "disarmed", "reason": reason, "pid": self.pid})
                except OSError:
                    pass
        return ended

    def after_fork_in_child(self) -> None:
        """A child forked from this process has its recorder (inherited) but not the listener
        thread: a fresh, disarmed session and a socket of its own."""
        rec = self.rec
        rec.armed = rec.session_open = rec.stepping = rec.cued = rec.draining = False
        rec.hold_bytes, rec._hold_limit, rec._held = None, None, None  # nor the parent's held
        rec._writer, rec._deferred = None, None  # the parent's writer and tap thread
        rec.session_lock = threading.Lock()
        rec.lock = threading.Lock()
        if self.server is not None:
            self.server.close()  # the parent's listener fd (the parent keeps listening)
        child = Channel(rec, self.engine, self.run_dir)
        _CHANNELS[0:1] = [child]
        try:
            child.start()
        except OSError as exc:
            print(f"hstrace: no control channel in {os.getpid()}: {exc}", file=sys.stderr)


_CHANNELS: list[Channel] = []


def serve(rec: Recorder, engine: str) -> Channel | None:
    """Open this process's control channel when its recorder is dormant and names a run dir.
    A failure leaves the server serving, dormant and unarmable, and says why on stderr."""
    run_dir = rec.cfg.get("control")
    if not rec.dormant or not run_dir:
        return None
    channel = Channel(rec, engine, Path(run_dir))
    try:
        channel.start()
    except OSError as exc:
        print(f"hstrace: no control channel: {exc}", file=sys.stderr, flush=True)
        return None
    _CHANNELS[:] = [channel]
    os.register_at_fork(after_in_child=lambda: _CHANNELS[0].after_fork_in_child())
    return channel


def _private_dir(path: Path) -> None:
    """The run dir: created 0700; an existing one must be this user's and closed to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"{path}: the control dir must belong to this user with mode 0700 "
            f"(owner uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))})"
        )


def _peer_allowed(conn: socket.socket) -> bool:
    """Only the server's own user (or root) may arm it: the kernel's word, not the client's."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return False
    _pid, uid, _gid = struct.unpack("3i", raw)
    return uid in (os.getuid(), 0)


def _title() -> str:
    """This process's title as `ps` shows it (engines rename their processes, e.g. SGLang's
    `sglang::scheduler_TP0`), else its argv."""
    try:
        raw = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return " ".join(sys.argv)
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part).strip()


def _send(fh: Any, obj: dict[str, Any]) -> None:
    fh.write((json.dumps(obj, default=str) + "\n").encode())
