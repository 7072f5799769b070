"""The replay room: put serving next to training through one reference drafter and build the
evidence of where they part, in named stages (one module and one entry function each):

read (`read.read_serving`) → align (`align.align`, `align.Alignment.build`) → compare
(`evidence.build_evidence`: `slots`, `accuracy`, `agreement`, `inputs` over the pure `compare`
and the reference `runner`) → what-if (`whatif.search_whatifs`) → judge (`run.judge`: the
checks handed in from above, the result in `result.ReplayResult`).

What could not be computed is noted as it is built (`unavailable`). No module of this package
imports `hstrace.diagnose`. `hstrace.replay` is this package only: the public function that
replays a trace and diagnoses it is `hstrace.replay_trace` (`hstrace.pipelines.replay_trace`).
"""

from hstrace.replay.result import ReplayResult

__all__ = ["ReplayResult"]
