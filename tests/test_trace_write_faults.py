"""Write faults reach the producer clearly and lose nothing committed (issue 12, item 4): a full
disk (ENOSPC), a read-only remount (EROFS) and the output directory removed mid-run. The
writer process never prints a traceback; the producer's next write (and close) raises a
TraceError naming the path, the cause and what the trace kept, which reads back intact.

ENOSPC and EROFS are real: a small tmpfs mounted in a private user + mount namespace
(`unshare -rm`), so no root is needed; those tests skip where user namespaces are off."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest
from helpers.trace_steps import script_env, step_data

from hstrace.errors import TraceError
from hstrace.trace import TraceWriter, create_trace, open_trace

FAULT_SCRIPT = """
import json, os, subprocess, sys, time
from helpers.trace_steps import step_data, verify_prefix
from hstrace.errors import TraceError
from hstrace.trace import TraceWriter, create_trace
root, mode = sys.argv[1], sys.argv[2]
path = os.path.join(root, "t.zarr")
create_trace(path, engine={{"name": "test"}})
w = TraceWriter(path, rank=0, tail_flush_s=0.2, staging_bytes=8 << 20, max_part_bytes=1 << 20)
for s in range(20):
    w.write("target", **step_data(s))
w.flush()
if mode == "erofs":
    subprocess.run(["mount", "-o", "remount,ro", root], check=True)
err, s = None, 20
try:
    while s < 200000:
        w.write("target", **step_data(s))
        s += 1
        if s % 20 == 0:
            time.sleep(0.05)  # a server's pace: the writer keeps up and tail-flushes
except TraceError as exc:
    err = str(exc)
try:
    w.close()
    close_err = None
except TraceError as exc:
    close_err = str(exc)
print(json.dumps({{"error": err, "close_error": close_err, "written": s,
                  "committed": verify_prefix(path), "path": path}}))
"""


def _namespace_ok() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'd=$(mktemp -d) && mount -t tmpfs -o size=1m none "$d"'],
        capture_output=True,
    )
    return probe.returncode == 0


needs_namespace = pytest.mark.skipif(
    not _namespace_ok(), reason="needs unshare -rm (user + mount namespaces) to mount a tmpfs"
)


def _run_fault(tmp_path, mode: str, size: str) -> tuple[dict, str]:
    root = tmp_path / "mnt"
    root.mkdir()
    script = FAULT_SCRIPT.format()  # (the script doubles its braces)
    out = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f'mount -t tmpfs -o size={size} none "$0" && exec "$1" -c "$2" "$0" "$3"',
            str(root),
            sys.executable,
            script,
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=script_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _kept_steps(message: str) -> int:
    m = re.search(r"kept: (\d+) steps of target", message)
    assert m, message
    return int(m.group(1))


@needs_namespace
def test_disk_full_is_reported_with_path_cause_and_what_was_kept(tmp_path):
    res, stderr = _run_fault(tmp_path, "enospc", "6m")
    err = res["error"]
    assert err is not None, res
    assert res["path"] in err and "ENOSPC" in err and "no space left" in err, err
    # What the message says was kept is what the trace holds, and it reads back bit-exact
    # (verify_prefix checked every committed step against what was written).
    assert _kept_steps(err) == res["committed"] >= 20, res
    assert res["committed"] < res["written"]
    assert res["close_error"] == err  # close says the same, instead of a generic exit
    assert "Traceback" not in stderr, stderr


@needs_namespace
def test_read_only_remount_is_reported_and_the_committed_prefix_stays(tmp_path):
    res, stderr = _run_fault(tmp_path, "erofs", "64m")
    err = res["error"]
    assert err is not None, res
    assert res["path"] in err and "EROFS" in err and "read-only" in err, err
    assert _kept_steps(err) == res["committed"] >= 20, res  # flushed before the remount
    assert res["close_error"] == err
    assert "Traceback" not in stderr, stderr


def _first_error(write, start: int, pause_s: float = 0.0, timeout_s: float = 30) -> str | None:
    """Call write(s) for s = start, start + 1, ... until it raises TraceError (its text) or
    timeout_s passes (None)."""
    deadline = time.monotonic() + timeout_s
    s = start
    while time.monotonic() < deadline:
        try:
            write(s)
            s += 1
        except TraceError as exc:
            return str(exc)
        if pause_s:
            time.sleep(pause_s)
    return None


def test_output_directory_removed_mid_run_fails_the_next_writes(tmp_path):
    path = tmp_path / "gone.zarr"
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, rank=0, tail_flush_s=0.2)
    for s in range(10):
        w.write("target", **step_data(s))
    w.flush()
    shutil.rmtree(path)
    err = _first_error(lambda s: w.write("target", **step_data(s)), start=10, pause_s=0.01)
    assert err is not None, "writes kept succeeding into a removed trace"
    assert str(path) in err and "removed or replaced" in err, err
    assert "kept: nothing (the trace is gone)" in err, err
    with pytest.raises(TraceError, match="removed or replaced"):
        w.close()
    # The writer did not recreate a headless rank group (zarr would have, silently).
    assert not path.exists(), sorted(p.name for p in path.rglob("*"))


def test_a_replaced_output_directory_is_not_written_into(tmp_path):
    """A new trace created at the same path is someone else's: the old writer stops."""
    path = tmp_path / "re.zarr"
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, rank=0, tail_flush_s=0.2)
    for s in range(5):
        w.write("target", **step_data(s))
    w.flush()
    shutil.rmtree(path)
    create_trace(path, engine={"name": "other"})
    with pytest.raises(TraceError, match="removed or replaced"):
        for s in range(5, 3000):
            w.write("target", **step_data(s))
            time.sleep(0.01)
    with pytest.raises(TraceError):
        w.close()
    with open_trace(path) as tr:
        assert tr.ranks == []  # nothing of the old run leaked into the new trace


def test_a_directory_removed_under_a_streaming_producer_is_not_recreated(tmp_path):
    """Large steps back to back, each a shared-memory descriptor (no pipe message to check the
    directory at): the writer stops rather than let zarr recreate a headless rank group."""
    path = tmp_path / "stream.zarr"
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, rank=0, tail_flush_s=0.2)
    steps = [step_data(s) for s in (7, 47)]  # 3000-token steps: the writer stays behind
    for s in range(10):
        w.write("target", **steps[s % 2])
    w.flush()
    shutil.rmtree(path)
    err = _first_error(lambda s: w.write("target", **steps[s % 2]), start=10)
    assert err is not None and "removed or replaced" in err, err
    with pytest.raises(TraceError, match="removed or replaced"):
        w.close()
    assert not path.exists(), sorted(p.name for p in path.rglob("*"))


def test_output_directory_moved_mid_run_says_what_was_kept_and_where(tmp_path):
    """Issue 24: a trace moved (not removed) while recording keeps every committed step in its
    new place; the message says how many and where, not "kept: nothing (the trace is gone)"."""
    path, moved = tmp_path / "here.zarr", tmp_path / "elsewhere" / "there.zarr"
    moved.parent.mkdir()
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, rank=0, tail_flush_s=0.2)
    for s in range(12):
        w.write("target", **step_data(s))
    w.flush()
    path.rename(moved)
    err = _first_error(lambda s: w.write("target", **step_data(s)), start=12, pause_s=0.01)
    assert err is not None, "writes kept succeeding into a moved trace"
    assert err.startswith(f"{path}: rank 0 stopped recording: "), err
    assert f"the trace directory was moved to {moved} while recording" in err, err
    assert "the trace is gone" not in err and "nothing" not in err, err
    kept = _kept_steps(err)
    assert f", in {moved}" in err, err
    with pytest.raises(TraceError, match="moved to"):
        w.close()
    assert not path.exists()  # nothing recreated at the old path
    with open_trace(moved) as tr:  # the message's count is what the moved trace holds
        assert tr.rank(0).table("target").num_steps == kept >= 12


@needs_namespace
def test_record_through_a_read_only_remount_names_it_and_keeps_a_readable_trace(tmp_path):
    """Issue 24: `hstrace record` (the reference engine, whose writer runs on the caller's
    thread) through a real read-only remount mid-run (a tmpfs in `unshare -rm`, remounted `ro`
    one second after the rank group appears): exit 1, one `hstrace: error:` line with the
    path, EROFS and what was kept; before, "unexpected OSError" (exit 2)."""
    from helpers.cli import REPO, TINY_WORLD, TRAINING

    root = tmp_path / "mnt"
    root.mkdir()
    out = root / "x.zarr"
    record = [
        sys.executable, "-m", "hstrace", "record", "--engine", "reference",
        "--target", str(TINY_WORLD / "target"),
        "--drafter", str(TINY_WORLD / "drafter-speculators"),
        "--prompts-from", str(TRAINING), "--samples", "48", "--max-new-tokens", "64",
        "--out", str(out),
    ]  # fmt: skip
    remount = (
        f'while [ ! -e "{out}/rank0/zarr.json" ]; do sleep 0.05; done; sleep 1; '
        f'mount -o remount,ro "{root}"'
    )
    script = (
        f'mount -t tmpfs -o size=256m none "{root}" && ({remount}) & '
        f'"$0" "$@"; rc=$?; echo "rc=$rc"; "{sys.executable}" -m hstrace show "{out}" --json'
    )
    run = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, *record],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert "rc=1" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "unexpected" not in run.stderr, run.stderr
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("hstrace: error:")]
    assert len(errors) == 1, run.stderr
    err = errors[0]
    assert err.startswith(f"hstrace: error: {out}: rank 0 stopped recording: "), err
    assert "the file system is read-only (EROFS)" in err and "kept: " in err, err
    summary = json.loads(run.stdout[run.stdout.index("{") :])  # still readable, as it says
    assert summary["clean_close"] is False
    kept = {t: int(n) for n, t in re.findall(r"(\d+) steps of (\w+)", err)}
    if "kept: no committed steps yet" in err:
        assert not any(summary["steps"].values()), summary["steps"]
    else:  # what the message says was kept is what the trace holds
        assert kept and {t: summary["steps"].get(t) for t in kept} == kept, (err, summary)
