"""Training-data readers on bad or unusual input: every failure is a one-line TrainingDataError
naming the path and what was found."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hstrace.errors import TrainingDataError
from hstrace.training import open_training
from hstrace.training import speculators as spec_mod

_CONF = Path(__file__).parent / "conformance" / "test_training_readers.py"
_spec = importlib.util.spec_from_file_location("training_conformance", _CONF)
conf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conf)
WORLD = Path(__file__).resolve().parents[1] / "traces" / "tiny-world"


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_unknown_layout_says_what_was_found(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "notes").mkdir()
    with pytest.raises(TrainingDataError) as exc:
        open_training(tmp_path)
    msg = one_line(exc)
    assert "unknown training-data layout" in msg and "weights.bin" in msg and "notes/" in msg


def test_missing_path_and_file_path(tmp_path):
    with pytest.raises(TrainingDataError, match="does not exist"):
        open_training(tmp_path / "nope")
    f = tmp_path / "f.pt"
    f.write_bytes(b"")
    with pytest.raises(TrainingDataError, match="found a file"):
        open_training(f)


def test_eagle_ge_data_is_named(tmp_path):
    torch.save(
        {
            "input_ids": torch.arange(4),
            "hidden_state": torch.zeros(4, 8),
            "loss_mask": torch.ones(4),
        },
        tmp_path / "data_0.ckpt",
    )
    with pytest.raises(TrainingDataError, match="EAGLE-1/2 ge_data"):
        open_training(tmp_path)


def test_legacy_v0_tensor_hidden_states_is_rejected(tmp_path):
    torch.save(
        {
            "input_ids": torch.arange(4),
            "hidden_states": torch.zeros(4, 24),
            "loss_mask": torch.ones(4),
        },
        tmp_path / "data_0.pt",
    )
    td = open_training(tmp_path)
    with pytest.raises(TrainingDataError) as exc:
        td[0]
    assert "list of >= 2" in one_line(exc) and "[4, 24]" in str(exc.value)


def test_pickled_objects_are_refused(tmp_path):
    # weights_only=True: an arbitrary pickled class never runs; it is reported as corrupt
    torch.save(
        {
            "input_ids": torch.arange(3),
            "hidden_states": [Path("x")] * 2,
            "loss_mask": torch.ones(3),
        },
        tmp_path / "data_0.pt",
    )
    td = open_training(tmp_path)
    with pytest.raises(TrainingDataError, match="pickle refused"):
        td[0]


def test_speculators_token_ids_must_match_the_dataset_row(tmp_path):
    samples = conf.make_samples()
    files = conf.write_speculators(tmp_path / "d", samples)
    hs = torch.cat([samples[0]["aux"], samples[0]["last"][:, None]], 1).contiguous()
    save_file({"token_ids": samples[0]["ids"] + 1, "hidden_states": hs}, str(files[0]))
    td = open_training(tmp_path / "d")
    with pytest.raises(TrainingDataError, match="differ from dataset row 0"):
        td[0]


def test_speculators_missing_keys_and_shape_mismatch(tmp_path):
    samples = conf.make_samples()
    files = conf.write_speculators(tmp_path / "d", samples)
    save_file({"token_ids": samples[1]["ids"]}, str(files[1]))
    bad_last = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    save_file({"token_ids": samples[2]["ids"], "hidden_states": bad_last}, str(files[2]))
    td = open_training(tmp_path / "d")
    with pytest.raises(TrainingDataError, match="missing keys"):
        td[1]
    with pytest.raises(TrainingDataError, match="aux slots have shape"):
        td[2]


def test_speculators_without_pyarrow_degrades_to_an_all_ones_mask(tmp_path, monkeypatch):
    samples = conf.make_samples()
    conf.write_speculators(tmp_path / "d", samples)
    monkeypatch.setattr(spec_mod, "have_pyarrow", lambda: False)
    with pytest.warns(UserWarning, match="loss mask unavailable"):
        td = open_training(tmp_path / "d")
    s = td[0]
    assert s.loss_mask.all() and "pyarrow not installed" in s.provenance["loss_mask_source"]
    assert torch.equal(s.input_ids, samples[0]["ids"]) and len(td) == len(samples)


def test_legacy_layer_id_count_must_match_slots(tmp_path):
    conf.write_legacy(tmp_path / "d", conf.make_samples())
    (tmp_path / "d" / "data_config.json").write_text(
        json.dumps({"hidden_states": {"layer_ids": [1, 2]}})
    )
    td = open_training(tmp_path / "d")
    with pytest.raises(TrainingDataError, match="lists 2 layer ids"):
        td[0]


def test_hf_datasets_reads_the_tiny_world_dataset():
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_from_disk(str(WORLD / "training-speculators"))
    td = open_training(WORLD / "training-speculators")
    assert len(ds) == len(td)
    row = ds[5]
    assert list(row["input_ids"]) == td[5].input_ids.tolist()
    assert [bool(x) for x in row["loss_mask"]] == td[5].loss_mask.tolist()


def test_a_parent_folder_is_not_a_dataset(tmp_path):
    """Pointing at a folder that merely contains datasets (e.g. /tmp, or a folder of several
    dumps) must not merge them: legacy `data_*.pt` files count only directly in the root."""
    import shutil

    for name in ("a", "b"):
        shutil.copytree(WORLD / "training-speculators-legacy", tmp_path / name)
    assert len(open_training(tmp_path / "a")) == len(open_training(tmp_path / "b"))
    with pytest.raises(TrainingDataError) as exc:
        open_training(tmp_path)
    assert "unknown training-data layout" in one_line(exc)


def test_gzip_sample_is_inflated_with_a_cap(tmp_path, monkeypatch):
    """A SpecForge `.ckpt.gz` is inflated in blocks, never past its cap (issue 12: 1.5 MB that
    inflated to 1.5 GiB took 3.3 GB of RAM); a genuine one still loads."""
    import gzip
    import io
    import shutil

    from hstrace.training import safe_load

    src = WORLD / "training-specforge"
    shutil.copytree(src, tmp_path / "ok")
    f = tmp_path / "ok" / "rows_0-48" / "data_0.ckpt"
    f.with_name("data_0.ckpt.gz").write_bytes(gzip.compress(f.read_bytes()))
    f.unlink()
    good = open_training(tmp_path / "ok")[0]
    assert torch.equal(good.input_ids, open_training(src)[0].input_ids)

    monkeypatch.setattr(safe_load, "GZIP_MIN_LIMIT", 8 << 20)  # keep the test small
    bomb = tmp_path / "bomb.ckpt.gz"
    one = gzip.compress(bytes(1 << 20), compresslevel=9)
    bomb.write_bytes(one * 64)  # 64 MiB of zeros from ~65 KB
    with pytest.raises(TrainingDataError) as exc:
        safe_load.load_torch(bomb)
    assert "bomb.ckpt.gz" in one_line(exc) and "inflates past" in one_line(exc)
    buf = io.BytesIO(gzip.compress(b"not a torch file" * 10))
    (tmp_path / "junk.ckpt.gz").write_bytes(buf.getvalue()[:40])
    with pytest.raises(TrainingDataError) as exc:
        safe_load.load_torch(tmp_path / "junk.ckpt.gz")
    assert "junk.ckpt.gz: " in one_line(exc) and "weights_only` set to `False`" not in str(exc)


def test_a_sample_of_another_hidden_width_is_named(tmp_path):
    samples = conf.make_samples()
    files = conf.write_speculators(tmp_path / "d", samples)
    s = samples[2]
    wide = torch.cat([s["aux"], s["last"][:, None]], 1)
    wide = torch.cat([wide, wide[..., :4]], -1).contiguous()  # Ht + 4
    save_file({"token_ids": s["ids"], "hidden_states": wide}, str(files[2]))
    td = open_training(tmp_path / "d")
    td[0], td[1]
    with pytest.raises(TrainingDataError) as exc:
        list(td.samples())
    msg = one_line(exc)
    assert files[2].name in msg and "hidden width" in msg and files[0].name in msg


def test_raw_pickle_prints_no_torch_warning(tmp_path):
    """torch warns about a non-default pickle protocol before weights_only refuses the file;
    the user sees only our one line."""
    import pickle
    import subprocess
    import sys

    (tmp_path / "data_0.pt").write_bytes(pickle.dumps({"input_ids": [1, 2, 3]}, protocol=4))
    code = (
        "import sys; from hstrace.training import open_training\n"
        f"td = open_training({str(tmp_path)!r})\n"
        "try:\n    td[0]\nexcept Exception as e:\n    print(type(e).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "TrainingDataError", out
    assert "Warning" not in out.stderr, out.stderr
