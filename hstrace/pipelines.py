"""The top of the library: pipelines that put the rooms together, so the rooms need not.

`replay_trace` (public: `hstrace.replay_trace`) = the replay room's evidence (`hstrace.replay.run.replay_with`) judged by the
diagnose room's checks; `bundle` = a bundle whose REPORT.md verdict is that replay, run on the
bundled subset. The rooms below never import this module or each other upwards: bundle does
not run replay, replay does not import diagnose (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from hstrace.replay.result import ReplayResult


def replay_trace(
    trace_path: str | os.PathLike[str],
    against: str | os.PathLike[str] | None = None,
    drafter_path: str | os.PathLike[str] | None = None,
    target_path: str | os.PathLike[str] | None = None,
    progress: Any = None,
    salt_file: str | os.PathLike[str] | None = None,
) -> ReplayResult:
    """Replay a trace against training tensors (or another trace) and diagnose it. Without
    `against`, requests are judged against the target's forward on the served tokens
    (`target_path`, else the trace's own target when it exists here), and the result lists
    what could not be judged (`ReplayResult.not_judged`)."""
    from hstrace.diagnose import diagnose
    from hstrace.replay.run import replay_with

    if _is_mtp(Path(trace_path)):  # an MTP head's trace: its own replay, its own checks
        from hstrace.diagnose.mtp import diagnose_mtp
        from hstrace.errors import HstraceError
        from hstrace.replay.mtp import replay_mtp

        if against is None:
            raise HstraceError(
                f"{trace_path} is an MTP head's trace: its replay needs the MTP training dump "
                "(give --against MTP_TRAINING_DIR)"
            )

        return replay_mtp(
            diagnose_mtp,
            Path(trace_path),
            Path(against),
            Path(target_path) if target_path is not None else None,
        )
    return replay_with(
        diagnose,
        Path(trace_path),
        Path(against) if against is not None else None,
        Path(drafter_path) if drafter_path is not None else None,
        Path(target_path) if target_path is not None else None,
        progress=progress,
        salt_file=Path(salt_file) if salt_file is not None else None,
    )


def _is_mtp(trace_path: Path) -> bool:
    from hstrace.replay.mtp import is_mtp_trace
    from hstrace.trace import open_trace

    if not ((trace_path / "zarr.json").is_file() or trace_path.suffix == ".zip"):
        return False  # not a trace: replay_with says why
    with open_trace(trace_path) as tr:
        return is_mtp_trace(tr.meta)


def replay_verdict(against: str | os.PathLike[str], drafter: str | os.PathLike[str] | None) -> Any:
    """A bundle's verdict function: (Markdown, replay JSON) of
    `replay_trace(store, against, drafter)`."""

    def verdict(store: Path) -> tuple[str, dict[str, Any]]:
        from hstrace.report import render_markdown

        result = replay_trace(store, against, drafter)
        return render_markdown(result), result.to_json()

    return verdict


def bundle(trace_path: str | os.PathLike[str], out: str | os.PathLike[str], opts: Any) -> Any:
    """`hstrace bundle`: `make_bundle`, with the replay verdict when `opts.against` is set."""
    from hstrace.bundle import make_bundle

    if opts.against and opts.verdict is None:
        opts = dataclasses.replace(opts, verdict=replay_verdict(opts.against, opts.drafter))
    return make_bundle(trace_path, out, opts)
