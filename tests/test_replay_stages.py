"""The replay is a few named stages, read → align → compare → what-if → judge: every module of
`hstrace/replay` imports only modules of its own stage or earlier ones (lazy imports too), so
the evidence flows one way from the trace to the verdict and never returns to a room it left."""

from __future__ import annotations

import ast
from pathlib import Path

REPLAY = Path(__file__).resolve().parent.parent / "hstrace" / "replay"

# module -> its position in the walk (shared helpers first; equal numbers: same stage).
ORDER: dict[str, int] = {
    "unavailable": 0,  # what a piece could not compute (every stage notes into one)
    "read": 1,  # stage read: read_serving
    "align": 2,  # stage align: align, Alignment.build
    "compare": 3,  # stage compare: the pure comparisons
    "runner": 4,  # the reference drafter and the one capture scan
    "slots": 5,  # stage compare: the evidence pieces
    "accuracy": 5,
    "agreement": 5,
    "fed": 5,
    "ranks": 5,  # every rank next to rank 0
    "whatif": 6,  # stage what-if: search_whatifs
    "evidence": 7,  # the typed evidence: build_evidence runs compare and what-if
    "result": 8,  # stage judge: the checks' judgement, the result
    "run": 8,
}


def _imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("hstrace.replay."):
                out.append((node.module.split(".")[2], node.lineno))
            elif node.module == "hstrace.replay":
                out += [(a.name, node.lineno) for a in node.names if a.name in ORDER]
        elif isinstance(node, ast.Import):
            out += [
                (a.name.split(".")[2], node.lineno)
                for a in node.names
                if a.name.startswith("hstrace.replay.")
            ]
    return out


def test_every_replay_module_has_its_stage():
    modules = {p.stem for p in REPLAY.glob("*.py")} - {"__init__"}
    assert modules == set(ORDER), "a replay module without a stage (or a stage without module)"
    assert len(modules) + 1 <= 15  # 22 files before the stages were named


def test_replay_modules_import_only_earlier_stages():
    back = []
    for path in sorted(REPLAY.glob("*.py")):
        if path.stem == "__init__":
            continue
        for module, line in _imports(path):
            if (
                module != path.stem
                and ORDER[module] >= ORDER[path.stem]
                and not (ORDER[module] == ORDER[path.stem] == 8 and module == "result")
            ):
                back.append(f"replay/{path.name}:{line} imports replay.{module}")
    assert not back, back
