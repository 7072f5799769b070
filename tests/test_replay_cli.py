"""`hstrace replay` from the command line: exit codes 0 / 1 / 2, --json, --markdown, and bad
input as one line (never a traceback). Runs on the committed example traces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.cli import EXAMPLES, REPO, TRAINING, Ran, assert_one_line_error, run_cli, run_main

pytestmark = pytest.mark.skipif(not EXAMPLES.is_dir(), reason="example traces not built")


def hstrace(*args: str, cwd: Path = REPO) -> Ran:
    """In-process through main() (exit code and one-line error as a user sees them); the
    tests marked `subprocess` below check the same contract through a real interpreter."""
    return run_main(*args, cwd=cwd)


def test_fault_exits_1_and_leads_with_the_verdict(tmp_path):
    """Through a subprocess: exit 1 is the interpreter's own exit status."""
    md = tmp_path / "report.md"
    run = run_cli(
        "replay",
        str(EXAMPLES / "aux-layer-shift.zarr"),
        "--against",
        str(TRAINING),
        "--markdown",
        str(md),
        cwd=REPO,
    )
    assert run.returncode == 1, run.stderr
    assert "aux-layer-shift" in run.stdout.split("findings")[0]  # the verdict comes first
    text = md.read_text()
    assert text.startswith("# hstrace replay") and "**Verdict: `aux-layer-shift`**" in text
    assert "eagle_aux_hidden_state_layer_ids" in text  # the fix names the config key


def test_clean_exits_0_with_json(tmp_path):
    # From another directory: the trace's recorded drafter/target paths still resolve.
    run = hstrace(
        "replay", str(EXAMPLES / "clean.zarr"), "--against", str(TRAINING), "--json", cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["schema_version"] == 1
    assert data["verdict"]["code"] == "no-wiring-fault"
    assert data["metrics"]["engine_vs_reference"]["within_noise"] is True
    evr = data["metrics"]["engine_vs_reference"]
    by_step = evr["by_step"]  # per draft_extend step, every compared row in exactly one
    assert sum(p["rows"] for p in by_step) == evr["rows"]
    assert [p["step"] for p in by_step] == sorted({p["step"] for p in by_step})
    assert all(set(p) >= {"top1_agreement", "topk_agreement", "max_logit_diff"} for p in by_step)
    assert data["coverage"]["aligned_requests"] == 8
    assert data["fingerprints"]["serving_layers"]["layer"] == [2, 4, 5]


def test_against_a_trace(tmp_path):
    run = hstrace(
        "replay",
        str(EXAMPLES / "aux-layer-shift.zarr"),
        "--against",
        str(EXAMPLES / "clean.zarr"),
        "--json",
    )
    assert run.returncode == 1, run.stderr
    assert json.loads(run.stdout)["verdict"]["code"] == "aux-layer-shift"


def _broken_trace(tmp_path: Path) -> Path:
    broken = tmp_path / "broken.zarr"
    shutil.copytree(EXAMPLES / "clean.zarr", broken)
    (broken / "zarr.json").write_text("{not json")
    return broken


BAD_INPUTS = {
    "missing trace": (
        lambda t: [str(t / "none.zarr"), "--against", str(TRAINING)],
        "no such trace",
    ),
    "missing training dir": (
        lambda t: [str(EXAMPLES / "clean.zarr"), "--against", str(t / "nowhere")],
        "nowhere",
    ),
    "unknown training layout": (
        lambda t: [str(EXAMPLES / "clean.zarr"), "--against", str(t)],
        "unknown training-data layout",
    ),
    "drafter dir without a checkpoint": (
        lambda t: [str(EXAMPLES / "clean.zarr"), "--against", str(TRAINING), "--drafter", str(t)],
        "no model.safetensors",
    ),
    "corrupt trace": (lambda t: [str(_broken_trace(t)), "--against", str(TRAINING)], "broken.zarr"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_exit_2(case, tmp_path):
    args, needle = BAD_INPUTS[case]
    assert_one_line_error(hstrace("replay", *args(tmp_path)), needle)


def test_a_corrupt_trace_is_one_line_from_a_real_interpreter(tmp_path):
    """The same contract through `python -m hstrace`: exit 2, one line, no traceback."""
    args, needle = BAD_INPUTS["corrupt trace"]
    assert_one_line_error(run_cli("replay", *args(tmp_path)), needle)


def test_without_against_the_traces_target_judges_it():
    """`--against` is optional (issue 26): the trace's own target (it exists here) judges every
    request through a reference twin (tests/test_replay_twins.py has the rest)."""
    run = hstrace("replay", str(EXAMPLES / "clean.zarr"), "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["coverage"]["target_twins"] == 8 and data["not_judged"] == []


def test_corrupt_drafter_checkpoint_exits_2(tmp_path):
    """A drafter dir whose weights file is garbage is bad input: one line, exit 2."""
    bad = tmp_path / "drafter"
    shutil.copytree(REPO / "traces" / "tiny-world" / "drafter-speculators", bad)
    (bad / "model.safetensors").write_bytes(b"\0" * 64)
    run = hstrace(
        "replay", str(EXAMPLES / "clean.zarr"), "--against", str(TRAINING), "--drafter", str(bad)
    )
    assert_one_line_error(run, "drafter")


def test_replay_reads_a_bundle_and_says_what_redaction_removed(tmp_path):
    """A bundle zip replays directly; with hidden states redacted, replay still checks what
    it can (the vocab map) and lists what it could not."""
    from hstrace import replay_trace
    from hstrace.bundle import BundleOptions, make_bundle

    plain = tmp_path / "plain.zip"
    make_bundle(EXAMPLES / "aux-layer-shift.zarr", plain, BundleOptions())
    assert replay_trace(plain, TRAINING).verdict.code == "aux-layer-shift"
    redacted = tmp_path / "redacted.zip"
    make_bundle(EXAMPLES / "aux-layer-shift.zarr", redacted, BundleOptions(redact=("hidden",)))
    result = replay_trace(redacted, TRAINING)
    assert "target.aux_hidden" in result.skipped and "draft_extend.hidden_in" in result.skipped
    assert "redact hidden" in result.skipped["draft_extend.hidden_in"]  # names the redaction
    assert "width" not in result.skipped["serving step-0 accuracy"]  # no misleading misfit
    assert result.metrics["target_space_top1"] == 1.0  # the vocab map was still checked
    assert "engine_vs_reference" not in result.metrics
    # The kept sketches still fingerprint every slot against the training slots and the
    # target's layers (both projected the same way): the layer shift is still named.
    assert result.verdict.code == "aux-layer-shift"
    assert result.verdict.evidence["fingerprinted_from"].startswith("per-slot sketches")
    assert result.fingerprints["serving_layers"]["layer"] == [3, 5, 6]
    assert result.inputs["redaction"]["modes"] == ["hidden"]


def test_hidden_redacted_clean_bundle_is_not_a_fault(tmp_path):
    """Sketch cosines are approximate, but identical states sketch identically: a clean trace's
    slots still match the training slots one to one."""
    from hstrace import replay_trace
    from hstrace.bundle import BundleOptions, make_bundle

    redacted = tmp_path / "clean-redacted.zip"
    make_bundle(EXAMPLES / "clean.zarr", redacted, BundleOptions(redact=("hidden",)))
    result = replay_trace(redacted, TRAINING)
    assert result.exit_code == 0, result.verdict
    assert result.fingerprints["serving_layers"]["layer"] == [2, 4, 5]
    cos = result.fingerprints["serving_x_training"]["cos"]
    assert all(cos[i][i] > 0.999 for i in range(3))


def test_ids_redacted_bundle_needs_its_salt_and_then_replays_fully(tmp_path):
    """`--redact ids` hashes every token id: without the salt replay cannot embed or align them
    (one line, exit 2, says what to pass); with it the ids are recovered and the verdict is the
    one of the unredacted trace."""
    bundle = tmp_path / "ids.zip"
    made = hstrace(
        "bundle", str(EXAMPLES / "aux-layer-shift.zarr"), "-o", str(bundle), "--redact", "ids"
    )
    assert made.returncode == 0, made.stderr
    salt = tmp_path / "ids.zip.salt"
    assert salt.is_file()

    moved = tmp_path / "kept-apart.salt"
    salt.rename(moved)
    assert_one_line_error(hstrace("replay", str(bundle), "--against", str(TRAINING)), "--salt-file")
    wrong = tmp_path / "wrong.salt"
    wrong.write_text("00" * 32)
    assert_one_line_error(
        hstrace("replay", str(bundle), "--against", str(TRAINING), "--salt-file", str(wrong)),
        "not the one",
    )

    run = hstrace(
        "replay", str(bundle), "--against", str(TRAINING), "--salt-file", str(moved), "--json"
    )
    assert run.returncode == 1, run.stderr
    data = json.loads(run.stdout)
    assert data["verdict"]["code"] == "aux-layer-shift"
    assert data["inputs"]["redaction"]["modes"] == ["ids"]
    assert data["coverage"]["aligned_requests"] == 8  # aligned on the recovered ids
    assert data["metrics"]["engine_vs_reference"]["top1_agreement"] == 1.0
