"""Replay: put serving next to training through one reference drafter and find where they part.

Pure parts (tensors in, numbers out): `align` (serving requests to training samples by token
ids), `fingerprint` (which slot holds which hidden state), `compare` (engine vs reference
draft outputs, judged against fp32), `whatif` (which misreading reproduces the engine); the
batched reference forwards live below, in `hstrace.reference`. The evidence, built once
(`evidence.build_evidence`) and read-only after: `sides` (the alignment), `slots`,
`accuracy`, `agreement` (with the what-if search of `hypotheses`), `draft_inputs`, `vocab`,
`batch`. I/O: `serving` (reads a trace), `run` (`replay_with` = `open_evidence` + `judge`,
which runs the checks it is given).

`hstrace.replay(...)` is the public entry point: a facade over `hstrace.pipelines.replay`
(replay + diagnose), kept here so `from hstrace.replay import replay` goes on working. No
module of this package imports `hstrace.diagnose`.
"""

import sys
import types

from hstrace.replay.result import ReplayResult


def replay(*args, **kwargs) -> ReplayResult:  # noqa: D103 - see hstrace.pipelines.replay
    from hstrace.pipelines import replay as _replay

    return _replay(*args, **kwargs)


class _CallablePackage(types.ModuleType):
    """`hstrace.replay` is both this package and the public function: importing the package
    binds it as `hstrace.replay`, shadowing the function, so the package itself calls it."""

    def __call__(self, *args, **kwargs) -> ReplayResult:
        return replay(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["ReplayResult", "replay"]
