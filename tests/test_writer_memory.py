"""The writer process fixes glibc's mmap threshold (writer_process.fix_mmap_threshold): with
glibc's dynamic threshold, a multi-MiB block freed raises it, and the next such block stays
in the heap after it is freed. Each case runs in a fresh interpreter (the threshold is
process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")

# Free a 4 MiB block, then touch and free a 2 MiB one: how much of it the process keeps (MiB).
CHILD = r"""
import ctypes, sys
from hstrace.trace.write.writer_process import fix_mmap_threshold
fixed = fix_mmap_threshold(int(sys.argv[1]))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
def touched(n):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    return p
libc.free(touched(4 << 20))
before = anon_kb()
libc.free(touched(2 << 20))
print(fixed, (anon_kb() - before) / 1024)
"""


def _kept_mib(threshold: int) -> tuple[bool, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(threshold)], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", float(out[1])


def test_fixed_threshold_gives_freed_blocks_back():
    fixed, kept = _kept_mib(1 << 20)
    assert fixed
    assert kept < 0.5


def test_dynamic_threshold_keeps_them():
    """The control: without the fix, the same 2 MiB stays resident after it is freed."""
    fixed, kept = _kept_mib(0)
    assert not fixed
    assert kept > 1.5


def test_a_bad_threshold_setting_keeps_the_default_and_sets_nothing(monkeypatch):
    from hstrace.trace.write import writer_process

    monkeypatch.setenv("HSTRACE_MMAP_THRESHOLD", "1MiB")
    assert writer_process.mmap_threshold_from_env() == 1 << 20
    assert not writer_process.fix_mmap_threshold(1 << 40)  # out of a C int: not passed on
