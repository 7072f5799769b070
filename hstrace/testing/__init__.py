"""Test support shipped with hstrace, for producers outside this repository.

`StoreConformance` (hstrace/testing/store_suite.py) is a pytest base class: subclass it, give
`make_trace`, and pytest runs the checks that prove a trace your producer wrote is one hstrace
reads (docs/trace-format.md, "Writing a trace as a third party"). Needs pytest (the `[test]`
extra); nothing in hstrace's core imports this package.
"""

from __future__ import annotations

from hstrace.testing.store_suite import (
    ConformanceError,
    ProducedTrace,
    StoreConformance,
    WriteLog,
    check_committed_prefix,
    check_corrupt_chunk,
    check_offsets,
    check_plain_zarr,
    check_round_trip,
    check_schema,
    check_summary,
    check_trace,
    record_writes,
)

__all__ = [
    "ConformanceError",
    "ProducedTrace",
    "StoreConformance",
    "WriteLog",
    "check_committed_prefix",
    "check_corrupt_chunk",
    "check_offsets",
    "check_plain_zarr",
    "check_round_trip",
    "check_schema",
    "check_summary",
    "check_trace",
    "record_writes",
]
