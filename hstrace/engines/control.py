"""The client of a dormant server's control channel (`hstrace arm` / `hstrace disarm`): find the
server's processes, create the trace, arm every process, hold the lease until the session ends,
and say in the trace how it ended. The server side is `hstrace.hooks.control`; the wire
protocol `hstrace.engines.protocol`.

SERVER is the run dir given at start-up (`dormant_env(engine, RUN_DIR)`) or the pid of any
process of the server (its HSTRACE_RECORD names the run dir; /proc/PID/environ is readable by
the server's user only).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hstrace.engines.protocol import DISARM_WAIT_S, ENV, SOCKET_SUFFIX
from hstrace.errors import HstraceError


def run_dir_of(server: str) -> Path:
    """The control run dir of SERVER (a directory, or a pid of one of the server's processes)."""
    path = Path(server)
    if path.is_dir():
        return path
    if not server.isdigit():
        raise HstraceError(f"{server}: neither a run directory nor a process id")
    try:
        environ = Path(f"/proc/{server}/environ").read_bytes()
    except FileNotFoundError:
        raise HstraceError(f"no process {server}") from None
    except PermissionError:
        raise HstraceError(
            f"process {server} belongs to another user: only the server's user may arm it"
        ) from None
    for item in environ.split(b"\0"):
        name, _, value = item.partition(b"=")
        if name.decode(errors="replace") == ENV and value:
            try:
                control = json.loads(value).get("control")
            except ValueError:
                control = None
            if control:
                return Path(control)
    raise HstraceError(
        f"process {server} was not started dormant ({ENV} names no control dir): start the "
        "server with hstrace.engines.protocol.dormant_env (see README: arming a running server)"
    )


class Connection:
    """One process's control socket: JSON lines each way."""

    def __init__(self, path: Path, timeout_s: float = 30.0) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(path))
        self.fh = self.sock.makefile("rwb", buffering=0)

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.fh.write((json.dumps(msg) + "\n").encode())
        return self.read()

    def read(self) -> dict[str, Any]:
        line = self.fh.readline()
        if not line:
            raise ConnectionError(f"{self.path}: the process closed the channel")
        return json.loads(line)

    def close(self) -> None:
        for closable in (self.fh, self.sock):
            try:
                closable.close()
            except OSError:
                pass


def connect_all(run_dir: Path) -> list[Connection]:
    """A connection to every live process of the server (sockets of dead ones are skipped)."""
    if not run_dir.is_dir():
        raise HstraceError(f"{run_dir}: no such run directory")
    conns = []
    for path in sorted(run_dir.glob(f"*{SOCKET_SUFFIX}")):
        try:
            conns.append(Connection(path))
        except (ConnectionRefusedError, FileNotFoundError):
            continue  # a process that exited
        except PermissionError:
            raise HstraceError(f"{path}: not yours: only the server's user may arm it") from None
    if not conns:
        raise HstraceError(f"{run_dir}: no live hstrace control socket (is the server running?)")
    return conns


@dataclass
class Session:
    """What an arm session did: the processes armed, how each session ended."""

    out: Path
    engine: str
    version: str
    armed: list[dict[str, Any]] = field(default_factory=list)
    ended: dict[int, str] = field(default_factory=dict)  # pid -> reason
    started: float = 0.0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(reason in ("disarm", "duration", "requests") for reason in self.ended.values())

    @property
    def held(self) -> list[int]:
        """The processes that held their steps (the rest, if any, built them as they came)."""
        return [r.get("pid") for r in self.armed if r.get("holds")]


def arm(
    server: str,
    out: Path,
    streams: list[str],
    on_full: str = "block",
    requests: int | None = None,
    duration_s: float | None = None,
    armed: Callable[[Session], None] | None = None,
    tap_thread: bool = True,
    work: str = "rows",
    hold_mb: float | None = None,
    drain_wait_s: float | None = None,
    hold_auto: bool = False,
) -> Session:
    """Arm every process of SERVER into a new trace at `out`, hold the lease until every
    process says its session ended (limit reached, `hstrace disarm`, or KeyboardInterrupt
    here: then this disarms), and write how it ended into the trace. `armed` is called once
    every process is armed (tests and the bench send traffic from it). `tap_thread` and `work`
    are the bench's (`bench/live_overhead.py`; `protocol.WORK_LEVELS`). `hold_mb`: each
    process holds the steps in memory, up to that many MiB, and builds their rows once the
    server has run no step for 50 ms (`hooks.common.Recorder.hold_bytes`): in its quiet
    moments while armed, and at the disarm, waiting then at most `drain_wait_s` (None:
    `protocol.DRAIN_WAIT_S`; 0: at once). `hold_auto`: the hold is a default, not asked for:
    processes whose hooks cannot hold stream instead of refusing the arm."""
    from hstrace.trace import create_trace

    if out.exists():
        raise HstraceError(f"{out} already exists; hstrace never overwrites a trace")
    conns = connect_all(run_dir_of(server))
    try:
        hellos = [c.ask({"cmd": "hello"}) for c in conns]
        busy = [h["pid"] for h in hellos if h.get("armed")]
        if busy:
            raise HstraceError(f"already armed: process(es) {busy} record a session now")
        engine, version = hellos[0]["engine"], hellos[0]["version"]
        create_trace(
            out,
            engine={"name": engine, "version": version},
            command_line=[],
            static={"engine_version": version, f"{engine}_version": version},
        )
        session = Session(out=out, engine=engine, version=version, started=time.time())
        msg = {
            "cmd": "arm",
            "out": str(out.resolve()),
            "streams": sorted(streams),
            "on_full": on_full,
            "requests": requests,
            "duration": duration_s,
            "tap_thread": tap_thread,  # False: a step's rows built inline (bench's variant)
            "work": work,  # protocol.WORK_LEVELS: anything but "rows" is the bench's
            "hold_mb": hold_mb,
            "drain_wait_s": drain_wait_s,
            "hold_auto": hold_auto,
        }
        live: list[Connection] = []
        for conn, hello in zip(conns, hellos, strict=True):
            reply = conn.ask(msg)
            if reply.get("error"):
                for other in live:  # never leave a half-armed server
                    other.close()
                raise HstraceError(f"process {reply.get('pid')}: {reply['error']}")
            session.armed.append({**reply, "title": hello.get("title")})
            live.append(conn)
        if armed is not None:
            armed(session)
        _hold(live, session)
        session.wall_s = time.time() - session.started
        _finish(session)
        return session
    finally:
        for conn in conns:
            conn.close()


def _hold(conns: list[Connection], session: Session) -> None:
    """Wait until every process's session ended. The first to end (its limit, `hstrace
    disarm`, its death) ends the others: only the processes that see steps can count
    requests, and a session is the whole server's. KeyboardInterrupt here disarms them all."""
    import selectors

    pending = {conn.fh: conn for conn in conns}
    asked = False
    with selectors.DefaultSelector() as sel:
        for conn in conns:
            conn.sock.settimeout(60)
            sel.register(conn.fh, selectors.EVENT_READ)
        try:
            while pending:
                for key, _ in sel.select():
                    conn = pending.get(key.fileobj)
                    if conn is None:
                        continue
                    try:
                        event = conn.read()
                    except (ConnectionError, OSError, ValueError):
                        event = {"event": "disarmed", "reason": "process_gone", "pid": _pid(conn)}
                    if event.get("event") != "disarmed":
                        continue  # the reply to our own disarm (its event came first)
                    session.ended[int(event["pid"])] = str(event["reason"])
                    del pending[key.fileobj]
                    sel.unregister(key.fileobj)
                if pending and not asked:
                    asked = True
                    _ask_disarm(pending.values())
        except KeyboardInterrupt:
            _ask_disarm(pending.values())
            for conn in pending.values():
                try:
                    while conn.read().get("event") != "disarmed":
                        pass
                except (ConnectionError, OSError, ValueError):
                    pass
                session.ended[_pid(conn)] = "interrupted"


def _ask_disarm(conns: Any) -> None:
    for conn in conns:
        try:
            conn.fh.write(b'{"cmd": "disarm"}\n')
        except OSError:
            pass


def _pid(conn: Connection) -> int:
    return int(conn.path.name.removesuffix(SOCKET_SUFFIX))


def _finish(session: Session) -> None:
    """Say in the trace how the session ended, and merge the front end's static facts."""
    import zarr

    root = zarr.open_group(str(session.out), mode="r+")
    meta = dict(root.attrs.get("hstrace", {}))
    static = dict(meta.get("static") or {})
    for reply in session.armed:
        for key, value in (reply.get("main_static") or {}).items():
            static.setdefault(key, value)
    meta["static"] = static
    meta["record"] = {
        "ok": session.ok,
        "error": None if session.ok else f"session ended: {sorted(set(session.ended.values()))}",
        "armed_in_running_server": True,
        "processes": [r.get("pid") for r in session.armed],
        "held": session.held,  # processes that held their steps (`hstrace arm --hold-mb`)
        "ended": {str(pid): reason for pid, reason in session.ended.items()},
        "wall_s": round(session.wall_s, 3),
        "hooks": True,
    }
    root.attrs["hstrace"] = meta


def disarm(server: str) -> dict[int, bool]:
    """Ask every process of SERVER to end its session: pid -> whether one was armed."""
    done: dict[int, bool] = {}
    for conn in connect_all(run_dir_of(server)):
        try:
            conn.sock.settimeout(DISARM_WAIT_S)
            reply = conn.ask({"cmd": "disarm"})
            done[int(reply["pid"])] = bool(reply.get("disarmed"))
        finally:
            conn.close()
    return done


def wait_sockets(run_dir: Path, n: int, timeout_s: float = 60.0) -> list[Path]:
    """The control sockets of a starting server, once `n` processes listen (tests, bench)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = sorted(run_dir.glob(f"*{SOCKET_SUFFIX}")) if run_dir.is_dir() else []
        live = [p for p in found if os.path.exists(f"/proc/{p.name.removesuffix(SOCKET_SUFFIX)}")]
        if len(live) >= n or time.monotonic() > deadline:
            return live
        time.sleep(0.2)
