"""One conformance class every training-data reader passes (in the style of zarr-python's store
tests): each format writes the same synthetic samples in its real on-disk layout, and the class
checks detection, fields, values, laziness and corruption handling through `open_training`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hstrace.errors import TrainingDataError
from hstrace.training import open_training
from hstrace.training.conventions import CONVENTIONS

H, N_AUX, LENGTHS = 8, 3, (5, 7, 6)


def make_samples(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Per sample: ids [T], mask [T], aux [T, 3, H] bf16, last [T, H] bf16."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in LENGTHS:
        out.append(
            {
                "ids": torch.randint(0, 100, (t,), generator=g),
                "mask": (torch.arange(t) >= 2).to(torch.int64),
                "aux": torch.randn(t, N_AUX, H, generator=g).to(torch.bfloat16),
                "last": torch.randn(t, H, generator=g).to(torch.bfloat16),
            }
        )
    return out


def write_speculators(root: Path, samples) -> list[Path]:
    import pyarrow as pa

    (root / "hidden_states").mkdir(parents=True)
    files = []
    for i, s in enumerate(samples):
        f = root / "hidden_states" / f"hs_{i}.safetensors"
        hs = torch.cat([s["aux"], s["last"][:, None]], 1).contiguous()
        save_file({"token_ids": s["ids"], "hidden_states": hs}, str(f))
        files.append(f)
    table = pa.table(
        {
            "input_ids": [s["ids"].tolist() for s in samples],
            "loss_mask": [s["mask"].tolist() for s in samples],
            "seq_len": [len(s["ids"]) for s in samples],
        }
    )
    with pa.OSFile(str(root / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_format_type": "torch"}
    (root / "state.json").write_text(json.dumps(state))
    return files


def write_legacy(root: Path, samples) -> list[Path]:
    root.mkdir(parents=True)
    files = []
    for i, s in enumerate(samples):
        f = root / f"data_{i}.pt"
        slots = [s["aux"][:, j].clone() for j in range(N_AUX)] + [s["last"].clone()]
        torch.save({"input_ids": s["ids"], "hidden_states": slots, "loss_mask": s["mask"]}, f)
        files.append(f)
    (root / "data_config.json").write_text(
        json.dumps({"hidden_states": {"layer_ids": [2, 4, 5, 7]}})
    )
    return files


def write_specforge(root: Path, samples, suffix: str = ".ckpt") -> list[Path]:
    import gzip
    import io

    group = root / f"rows_0-{len(samples)}"
    group.mkdir(parents=True)
    files = []
    for i, s in enumerate(samples):
        f = group / f"data_{i}{suffix}"
        d = {
            "input_ids": s["ids"],
            "loss_mask": s["mask"],
            "aux_hidden_state": s["aux"].flatten(1)[None].clone(),
            "hidden_state": s["last"][None].clone(),
        }
        if suffix.endswith(".gz"):
            buf = io.BytesIO()
            torch.save(d, buf)
            f.write_bytes(gzip.compress(buf.getvalue(), mtime=0))
        else:
            torch.save(d, f)
        files.append(f)
    return files


def write_mtp(root: Path, samples) -> list[Path]:
    """hstrace's MTP dump (`hstrace.training.mtp`): one fed state per token, no aux slots."""
    (root / "samples").mkdir(parents=True)
    meta = {"format": "hstrace-mtp", "version": 1, "hidden_source": "pre_final_norm"}
    (root / "mtp_training.json").write_text(json.dumps(meta))
    files = []
    for i, s in enumerate(samples):
        f = root / "samples" / f"sample_{i:05d}.safetensors"
        tensors = {"input_ids": s["ids"], "loss_mask": s["mask"].to(torch.uint8)}
        save_file(tensors | {"hidden_states": s["last"].contiguous()}, str(f))
        files.append(f)
    return files


# the aux slots each format hands out for a written sample (the MTP dump: its one fed state)
AUX_OF = {"hstrace-mtp": lambda s: s["last"][:, None]}

FORMATS = {
    # name: (writer, expected td.format, last_norm, slot_layer_ids)
    "speculators": (write_speculators, "speculators", "pre", None),
    "speculators-legacy": (write_legacy, "speculators-legacy", "pre", [2, 4, 5]),
    "specforge": (write_specforge, "specforge", "post", None),
    "hstrace-mtp": (write_mtp, "hstrace-mtp", "pre", None),
    "specforge-gz": (
        lambda r, s: write_specforge(r, s, ".ckpt.gz"),
        "specforge",
        "post",
        None,
    ),
}


@pytest.fixture(params=sorted(FORMATS))
def written(request, tmp_path):
    writer, fmt, last_norm, layer_ids = FORMATS[request.param]
    samples = make_samples()
    files = writer(tmp_path / "data", samples)
    return tmp_path / "data", files, samples, fmt, last_norm, layer_ids


class TestTrainingReaderConformance:
    def test_detects_format_and_length(self, written):
        root, _, samples, fmt, *_ = written
        td = open_training(root)
        assert td.format == fmt
        assert len(td) == len(samples)

    def test_fields_match_what_was_written(self, written):
        root, _, samples, _, last_norm, layer_ids = written
        td = open_training(root)
        for i, (s, want) in enumerate(zip(td.samples(), samples, strict=True)):
            assert s.index == i
            assert s.input_ids.dtype == torch.int64 and torch.equal(s.input_ids, want["ids"])
            assert s.loss_mask.dtype == torch.bool
            assert torch.equal(s.loss_mask, want["mask"].bool())
            aux = AUX_OF.get(td.format, lambda w: w["aux"])(want)
            assert s.aux.dtype == torch.bfloat16  # dtype as stored
            assert s.aux.shape == (len(want["ids"]), aux.shape[1], H)
            assert torch.equal(s.aux, aux)  # slots in stored order, bit-for-bit
            assert torch.equal(s.aux_concat, aux.flatten(1))
            assert torch.equal(s.last, want["last"])
            assert s.last_norm == last_norm
            assert s.slot_layer_ids == layer_ids
            assert s.provenance["format"] == td.format
            assert s.provenance["layer_id_convention"] in CONVENTIONS
            assert Path(s.provenance["file"]).is_file()

    def test_indexing(self, written):
        root, _, samples, *_ = written
        td = open_training(root)
        assert torch.equal(td[-1].input_ids, samples[-1]["ids"])
        assert td[-1].index == len(samples) - 1
        with pytest.raises(IndexError):
            td[len(samples)]

    def test_open_is_lazy_and_per_sample(self, written):
        # A sample file that disappears after open only breaks that sample: nothing was preloaded.
        root, files, samples, *_ = written
        td = open_training(root)
        files[1].unlink()
        assert torch.equal(td[0].input_ids, samples[0]["ids"])
        with pytest.raises(TrainingDataError, match=files[1].name):
            td[1]

    def test_truncated_file_is_a_clear_error(self, written):
        root, files, *_ = written
        td = open_training(root)
        files[2].write_bytes(files[2].read_bytes()[:40])
        with pytest.raises(TrainingDataError) as exc:
            td[2]
        assert files[2].name in str(exc.value) and "\n" not in str(exc.value)
