"""A shard made durable by tail flushes lives at its key (rowlog._Shard): each flush writes
only its tail and the index, never the shard so far again; the file at the key is a valid
shard at every moment, a killed writer leaves it readable bit-exact, and a clean close cuts
it to a plain shard that zarr itself reads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from hstrace.errors import TraceError
from hstrace.trace import TraceWriter, create_trace, open_trace
from hstrace.trace.liveshard import live_shard_bytes
from hstrace.trace.schema import unit_rows

WIDTH = 8192  # bf16: 16 KiB rows, the narrowest that are sharded
ROW_BYTES = WIDTH * 2
CHUNK_ROWS, SHARD_ROWS = unit_rows(ROW_BYTES)
TOKENS = 64  # per step; CHUNK_ROWS // TOKENS steps fill a chunk exactly
LIVE_BYTES = live_shard_bytes(SHARD_ROWS // CHUNK_ROWS, CHUNK_ROWS * ROW_BYTES)


def _step(s: int) -> dict:
    g = torch.Generator().manual_seed(s)
    return dict(
        step={"mode": 0},
        req={"req_key": torch.tensor([s]), "n_tok": torch.tensor([TOKENS])},
        tok={
            "input_ids": torch.arange(s, s + TOKENS, dtype=torch.int32),
            "positions": torch.arange(TOKENS, dtype=torch.int32),
            "aux_hidden": torch.randn(TOKENS, WIDTH, generator=g).to(torch.bfloat16),
        },
    )


def _aux_dir(path) -> str:
    return os.path.join(path, "rank0", "target", "tok.aux_hidden")


def _shard_file(path, unit: int = 0) -> str:
    return os.path.join(_aux_dir(path), "c", str(unit), "0")


def _wchar(pid: int) -> int:
    """Bytes the process handed to write calls (copy_file_range's in-kernel copies count)."""
    with open(f"/proc/{pid}/io") as f:
        return int(next(x for x in f if x.startswith("wchar:")).split()[1])


def _want(steps: int) -> np.ndarray:
    return np.concatenate(
        [_step(s)["tok"]["aux_hidden"].view(torch.int16).numpy() for s in range(steps)]
    )


def _check_rows(path, steps: int) -> None:
    with open_trace(path) as tr:
        t = tr.rank(0).table("target")
        assert t.num_steps == steps
        aux = t.column("tok", "aux_hidden").view(torch.int16).numpy()
        for s in range(steps):
            want = _step(s)["tok"]["aux_hidden"].view(torch.int16).numpy()
            assert np.array_equal(aux[s * TOKENS : (s + 1) * TOKENS], want), f"step {s}"


def test_layout_fits_the_schema():
    assert SHARD_ROWS is not None and SHARD_ROWS >= 4 * CHUNK_ROWS
    assert CHUNK_ROWS % TOKENS == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/<pid>/io")
def test_flushes_write_the_shard_once_and_a_kill_keeps_it(tmp_path):
    path = tmp_path / "t.zarr"
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, rank=0, tail_flush_s=60)
    per_chunk, flushes = CHUNK_ROWS // TOKENS, 6
    start = _wchar(w.writer_pid)
    for f in range(flushes):  # a whole chunk, then a flush: the shard so far grows by one
        for s in range(f * per_chunk, (f + 1) * per_chunk):
            w.write("target", **_step(s))
        w.flush()
    written = _wchar(w.writer_pid) - start
    key = _shard_file(path)
    st = os.stat(key)
    os.kill(w.writer_pid, signal.SIGKILL)
    with pytest.raises(TraceError):
        w.close()
    # The shard lives at its key, sparse: room for every chunk and two tail slots.
    assert st.st_size == LIVE_BYTES
    with open_trace(path) as tr:
        shard_bytes = tr.rank(0).table("target").num_rows("tok") * ROW_BYTES
    assert shard_bytes == flushes * CHUNK_ROWS * ROW_BYTES
    # Random bf16 codes to 0.67 of its size. Copying the shard so far at each flush wrote
    # 1 + 2 + ... + 6 chunks again: 3.0x the rows here; each chunk written once, 0.67x.
    assert written < 1.2 * shard_bytes, (written, shard_bytes)
    _check_rows(path, flushes * per_chunk)
    rows = flushes * CHUNK_ROWS  # zarr itself reads the live shard (its index ends the file)
    got = np.asarray(zarr.open_array(_aux_dir(path), mode="r")[:rows]).view(np.int16)
    assert np.array_equal(got, _want(flushes * per_chunk))


def test_a_live_shard_is_cut_to_a_plain_shard_at_close(tmp_path):
    """Flushed mid-shard with a partly filled chunk, then filled past its end, then closed:
    the first shard is finished in place at its exact size, the second from its tail; both
    read bit-exact through hstrace's reader and through zarr."""
    path = tmp_path / "t.zarr"
    create_trace(path, engine={"name": "test"})
    steps = SHARD_ROWS // TOKENS + 3
    with TraceWriter(path, rank=0, tail_flush_s=60) as w:
        for s in range(steps):
            w.write("target", **_step(s))
            if s in (5, 6, 40):  # tails in both slots, and a later one
                w.flush()
                assert os.path.getsize(_shard_file(path)) == LIVE_BYTES
    first = os.path.getsize(_shard_file(path, 0))
    assert first < SHARD_ROWS * ROW_BYTES  # cut: compressed chunks and the index, no slots
    assert not [n for n in os.listdir(os.path.dirname(_shard_file(path))) if "partial" in n]
    _check_rows(path, steps)
    arr = zarr.open_array(_aux_dir(path), mode="r")
    assert np.array_equal(np.asarray(arr[: steps * TOKENS]).view(np.int16), _want(steps))


def test_a_flush_right_before_close_still_cuts_the_live_shard(tmp_path):
    """Nothing written since the last tail flush (a server idle when it stops): close still
    finishes the live shard, its partly filled chunk appended and the slots cut off."""
    path = tmp_path / "t.zarr"
    create_trace(path, engine={"name": "test"})
    steps = CHUNK_ROWS // TOKENS + 2
    with TraceWriter(path, rank=0, tail_flush_s=60) as w:
        for s in range(steps):
            w.write("target", **_step(s))
        w.flush()
        assert os.path.getsize(_shard_file(path)) == LIVE_BYTES
    assert os.path.getsize(_shard_file(path)) < 2 * CHUNK_ROWS * ROW_BYTES
    _check_rows(path, steps)


FULL_DISK_SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[2])
from test_live_shard import _step, _check_rows
from hstrace.errors import TraceError
from hstrace.trace import TraceWriter, create_trace, open_trace
path = os.path.join(sys.argv[1], "t.zarr")
create_trace(path, engine={"name": "test"})
w = TraceWriter(path, rank=0, tail_flush_s=60)
err, s = None, 0
try:
    while s < 1000:
        w.write("target", **_step(s))
        s += 1
        if s in (6, 10):  # the shard goes live with a tail, then a tail in the other slot
            w.flush()
except TraceError as exc:
    err = str(exc)
try:
    w.close()
except TraceError:
    pass
with open_trace(path) as tr:
    committed = tr.rank(0).table("target").num_steps
_check_rows(path, committed)
print(json.dumps({"error": err, "written": s, "committed": committed}))
"""


def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'd=$(mktemp -d) && mount -t tmpfs -o size=1m none "$d"'],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(
    not shutil.which("unshare") or not _can_mount_tmpfs(),
    reason="needs unshare -rm (user + mount namespaces) to mount a tmpfs",
)
def test_a_full_disk_keeps_the_live_shard_as_of_its_last_flush(tmp_path):
    """ENOSPC (a real one: a 24 MiB tmpfs) while chunks go on into a live shard: the shard at
    the key still holds every row of the last flush, bit-exact."""
    root = tmp_path / "mnt"
    root.mkdir()
    out = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            'mount -t tmpfs -o size=24m none "$0" && exec "$1" -c "$2" "$0" "$3"',
            str(root),
            sys.executable,
            FULL_DISK_SCRIPT,
            os.path.dirname(os.path.abspath(__file__)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["error"] and "ENOSPC" in res["error"], res
    assert 10 <= res["committed"] < res["written"], res


def _moves_during_read(w: TraceWriter, action: str, steps: int, per_chunk: int) -> int:
    """What the writer does while a reader is between the index and the tail's bytes; the
    steps written by then."""
    if action == "two tail flushes":  # the tail back in the slot the reader was sent to
        for _ in range(2):
            w.write("target", **_step(steps))
            steps += 1
            w.flush()
    elif action == "chunk filled":  # the reader's chunk whole; the next one's tail moves on
        for _ in range(per_chunk):
            w.write("target", **_step(steps))
            steps += 1
        w.flush()
        w.write("target", **_step(steps))
        w.flush()
        steps += 1
    else:  # "shard finished": the file cut to a plain shard, the slots gone
        w.close()
    return steps


@pytest.mark.parametrize("action", ["two tail flushes", "chunk filled", "shard finished"])
def test_a_reader_follows_the_partly_filled_chunk_as_the_writer_moves_it(
    tmp_path, monkeypatch, action
):
    """A reader sent by the index to the live shard's tail slot, and the writer moving the
    tail before the reader reads it: the rows read are still the committed ones, bit-exact.
    (Read as the index said, the slot held another frame by then: a corrupt-chunk error.)"""
    from hstrace.trace import chunkread

    path = tmp_path / "t.zarr"
    create_trace(path, engine={"name": "test"})
    per_chunk = CHUNK_ROWS // TOKENS
    w = TraceWriter(path, rank=0, tail_flush_s=60, process=False)
    steps = per_chunk + 1  # a whole chunk, then a step of the next: the tail, in a slot
    for s in range(steps):
        w.write("target", **_step(s))
    w.flush()
    real, moved, reads = chunkread._pread_exact, [], []

    def read_late(fd, n, offset, where):
        if not moved:  # the first read of the tail's bytes: the writer goes first
            moved.append(_moves_during_read(w, action, steps, per_chunk))
        reads.append((offset, n))
        return real(fd, n, offset, where)

    monkeypatch.setattr(chunkread, "_pread_exact", read_late)
    with open_trace(path) as tr:
        t = tr.rank(0).table("target")
        assert t.num_steps == steps
        aux = t.column("tok", "aux_hidden").view(torch.int16).numpy()
    assert moved, "the reader never read a tail slot"
    assert np.array_equal(aux, _want(steps))
    if action == "two tail flushes":  # the index sent it back to the same slot, longer now
        assert reads[1][0] == reads[0][0] and reads[1][1] > reads[0][1], reads
    else:  # the chunk is whole below the slots now: read from there
        assert len(reads) == 1, reads
    if action != "shard finished":
        w.close()
    monkeypatch.undo()
    _check_rows(path, moved[0] if action != "shard finished" else steps)


LIVE_WRITER = """
import sys, time
sys.path.insert(0, sys.argv[3])
from test_live_shard import _step
from hstrace.trace import TraceWriter
with TraceWriter(sys.argv[1], rank=0, tail_flush_s=0.01) as w:
    for s in range(int(sys.argv[2])):
        w.write("target", **_step(s))
        time.sleep(0.003)
"""


def test_a_trace_reads_bit_exact_while_it_records(tmp_path):
    """`hstrace show` on a recording in progress: a writer process flushing its tail every
    10 ms, and a reader reading the newest committed steps over and over: every read is the
    committed rows, bit-exact, and none fails."""
    path = tmp_path / "t.zarr"
    create_trace(path, engine={"name": "test"})
    here = os.path.dirname(os.path.abspath(__file__))
    writer = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(path), "400", here])
    want: dict[int, np.ndarray] = {}
    reads = 0
    try:
        while writer.poll() is None:
            with open_trace(path) as tr:
                t = tr.rank(0).table("target") if 0 in tr.ranks else None  # not yet started
                n = 0 if t is None else t.num_steps
                if n == 0:
                    continue
                lo = max(0, n - 24)
                aux = t.column("tok", "aux_hidden", lo * TOKENS, n * TOKENS).view(torch.int16)
            for s in range(lo, n):
                if s not in want:
                    want[s] = _step(s)["tok"]["aux_hidden"].view(torch.int16).numpy()
                got = aux[(s - lo) * TOKENS : (s - lo + 1) * TOKENS].numpy()
                assert np.array_equal(got, want[s]), f"step {s} of {n}"
            reads += 1
    finally:
        writer.kill() if writer.poll() is None else None
    assert writer.wait() == 0
    assert reads >= 10, reads
    _check_rows(path, 400)
