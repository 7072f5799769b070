"""Hostile inputs against every reading command: nothing hangs, nothing blows up memory, nothing
lies (corrupt data is an error, not zeros), and every refusal is one named line.

Each hostile input is generated here from a good one (the committed clean example trace, the
tiny world's training dumps and drafters), then every reading command that takes it (`show`,
`replay`, `diff`, `report`, `bundle`, `check`) runs on it in its own forked process under an
address-space limit and an alarm (tests/hostile_runner.py). Every run must end with exit 2, one
line on stderr that starts with `hstrace: error:` and names the problem (the case's `words`), no
traceback, no warning printed first, within its time limit and memory budget.

Impossible values (issue 24) come from one generator per class (`gen_*`: metadata types,
clean-close offsets, unreadable rank groups, codecs, shard aliasing, widths, step sequence,
positions, out-of-vocabulary ids, drafter config values and weights, training values); each
case runs through the commands that read what it corrupts.

The figure "bad inputs handled" in the README's Reliability section is the number of runs here.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import zarr

ROOT = Path(__file__).resolve().parents[1]
CLEAN = ROOT / "traces" / "examples" / "clean.zarr"
WORLD = ROOT / "traces" / "tiny-world"
TRAIN = WORLD / "training-speculators"
DRAFTER = WORLD / "drafter-speculators"
RUNNER = Path(__file__).with_name("hostile_runner.py")

# Per run: generous against a 2-core shared machine, far below what the bugs took (minutes,
# gigabytes). The memory budget is address space above the preloaded runner (torch included).
TIMEOUT_S = 60
MEM_MB = 1536
TRACE_COMMANDS = ("show", "replay", "diff", "report", "bundle")


@dataclass
class Case:
    name: str
    path: Path  # the hostile input
    kind: str  # "trace" | "training" | "drafter" | "zip"
    words: tuple[str, ...]  # each must appear in the one-line message (case-insensitive)
    commands: tuple[str, ...] = ()
    argv: dict[str, list[str]] = field(default_factory=dict)


# --- generators ---------------------------------------------------------------------------


def _copy_clean(d: Path, name: str) -> Path:
    dst = d / f"{name}.zarr"
    shutil.copytree(CLEAN, dst, symlinks=True)
    return dst


def _edit_json(path: Path, edit) -> None:
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _rank_meta(t: Path):
    return lambda edit: _edit_json(
        t / "rank0" / "zarr.json", lambda m: edit(m["attributes"]["hstrace"])
    )


def _set_values(t: Path, table: str, array: str, index, value) -> None:
    arr = zarr.open_array(str(t / "rank0" / table / array), mode="r+")
    data = arr[:]
    data[index] = value
    arr[:] = data


def _chunk_files(t: Path, table: str, array: str) -> list[Path]:
    return sorted(f for f in (t / "rank0" / table / array / "c").rglob("*") if f.is_file())


def build_trace_cases(d: Path) -> list[Case]:
    cases: list[Case] = []

    def add(name: str, words: tuple[str, ...], make, commands=TRACE_COMMANDS) -> None:
        t = _copy_clean(d, name)
        make(t)
        cases.append(Case(name, t, "trace", words, commands))

    # 1. no hang / no memory bomb
    add(
        "n_proposed_1e9",
        ("verify", "n_proposed"),
        lambda t: _set_values(t, "verify", "req.n_proposed", 0, 10**9),
    )

    def dev_zero_meta(t: Path) -> None:
        f = t / "rank0" / "zarr.json"
        f.unlink()
        f.symlink_to("/dev/zero")

    add("rank_meta_symlink_dev_zero", ("rank0/zarr.json", "link"), dev_zero_meta)

    def dev_zero_root(t: Path) -> None:
        (t / "zarr.json").unlink()
        (t / "zarr.json").symlink_to("/dev/zero")

    add("root_meta_symlink_dev_zero", ("zarr.json", "link"), dev_zero_root)

    def huge_meta(t: Path) -> None:  # sparse: 8 GiB of NULs that take no disk
        f = t / "rank0" / "target" / "zarr.json"
        with open(f, "r+b") as fh:
            fh.truncate(8 << 30)

    add("table_meta_8GiB", ("rank0/target/zarr.json", "bytes"), huge_meta)

    def fifo_meta(t: Path) -> None:
        f = t / "rank0" / "verify" / "zarr.json"
        f.unlink()
        os.mkfifo(f)

    add("table_meta_fifo", ("rank0/verify/zarr.json", "not a regular file"), fifo_meta)

    def chunk_symlink(t: Path) -> None:
        f = _chunk_files(t, "target", "tok.input_ids")[0]
        f.unlink()
        f.symlink_to("/etc/passwd")

    add("chunk_symlink_etc_passwd", ("tok.input_ids", "link"), chunk_symlink)

    def huge_chunk(t: Path) -> None:  # a chunk file far bigger than its array can encode
        f = _chunk_files(t, "verify", "req.accept_len")[0]
        with open(f, "r+b") as fh:
            fh.truncate(4 << 30)

    add("chunk_4GiB_sparse", ("req.accept_len", "bytes"), huge_chunk)

    # 2. corrupt data is corrupt, not zeros
    add(
        "chunk_deleted",
        ("tok.input_ids", "missing"),
        lambda t: _chunk_files(t, "target", "tok.input_ids")[0].unlink(),
    )
    add(
        "shard_deleted",
        ("tok.aux_hidden", "missing"),
        lambda t: _chunk_files(t, "target", "tok.aux_hidden")[0].unlink(),
    )

    def dtype_edit(t: Path) -> None:
        _edit_json(
            t / "rank0" / "target" / "tok.aux_hidden" / "zarr.json",
            lambda m: m.update(data_type="float16"),
        )

    add("data_type_edited", ("tok/aux_hidden", "float16", "uint16"), dtype_edit)

    def dtype_edit_both(t: Path) -> None:  # the table's spec edited alike: the schema decides
        dtype_edit(t)
        _edit_json(
            t / "rank0" / "target" / "zarr.json",
            lambda m: m["attributes"]["hstrace"]["columns"]["tok"]["aux_hidden"].update(
                dtype="float16"
            ),
        )

    add("data_type_and_spec_edited", ("tok/aux_hidden", "float16"), dtype_edit_both)
    add(
        "token_id_negative",
        ("target", "input_ids", "-7"),
        lambda t: _set_values(t, "target", "tok.input_ids", 3, -7),
    )
    add(
        "token_id_2p30",
        ("target", "input_ids", str(2**30)),
        lambda t: _set_values(t, "target", "tok.input_ids", 3, 2**30),
    )
    add(
        "accept_len_negative",
        ("accept_len", "-3"),
        lambda t: _set_values(t, "verify", "req.accept_len", slice(None), -3),
    )
    add(
        "accept_len_above_n_proposed",
        ("accept_len", "n_proposed"),
        lambda t: _set_values(t, "verify", "req.accept_len", 0, 9),
    )
    add(
        "n_tok_disagrees_with_offsets",
        ("n_tok", "rows"),
        lambda t: _set_values(t, "target", "req.n_tok", 0, 10**6),
    )

    # 3. every exit-2 message names the problem
    add(
        "commit_tables_list",
        ("commit", "tables"),
        lambda t: _rank_meta(t)(lambda m: m["commit"].update(tables=["target", "verify"])),
    )
    add(
        "commit_rows_negative",
        ("commit", "negative"),
        lambda t: _rank_meta(t)(
            lambda m: m["commit"]["tables"]["target"]["rows"].update({"tok/input_ids": -5})
        ),
    )
    add(
        "commit_steps_string",
        ("commit", "steps"),
        lambda t: _rank_meta(t)(lambda m: m["commit"]["tables"]["verify"].update(steps="many")),
    )
    add(
        "engine_is_a_string",
        ("engine",),
        lambda t: _edit_json(
            t / "zarr.json", lambda m: m["attributes"]["hstrace"].update(engine="sglang")
        ),
    )
    add(
        "static_is_a_list",
        ("static",),
        lambda t: _edit_json(
            t / "zarr.json", lambda m: m["attributes"]["hstrace"].update(static=[1, 2])
        ),
    )

    def rank_is_array(t: Path) -> None:
        shutil.rmtree(t / "rank0")
        zarr.create_array(str(t / "rank0"), shape=(4,), dtype="int64", zarr_format=3)

    add("rank_group_is_an_array", ("rank0", "corrupt"), rank_is_array)
    add(
        "table_axes_not_a_list",
        ("rank0/verify", "axes"),
        lambda t: _edit_json(
            t / "rank0" / "verify" / "zarr.json",
            lambda m: m["attributes"]["hstrace"].update(axes=7),
        ),
    )

    def no_static_vocab(t: Path) -> None:
        def strip(m: dict) -> None:
            static = m["attributes"]["hstrace"]["static"]
            for k in ("target", "draft_config", "hot_token_id"):
                static.pop(k, None)

        _edit_json(t / "zarr.json", strip)
        _set_values(t, "target", "tok.input_ids", 3, 2**30)

    # No vocabulary in the audit: replay checks the ids against its drafter's before use.
    add(
        "token_id_2p30_no_static_vocab",
        ("token id", str(2**30), "vocabulary"),
        no_static_vocab,
        ("replay",),
    )

    def chunk_fifo(t: Path) -> None:
        f = _chunk_files(t, "verify", "req.n_proposed")[0]
        f.unlink()
        os.mkfifo(f)

    add("chunk_fifo", ("req.n_proposed", "not a regular file"), chunk_fifo)

    def chunk_garbage(t: Path) -> None:
        _chunk_files(t, "target", "req.n_tok")[0].write_bytes(b"garbage" * 10)

    add("chunk_garbage", ("req/n_tok",), chunk_garbage)

    def blosc_lies(t: Path) -> None:  # a header claiming a 2 GiB decoded chunk
        f = _chunk_files(t, "target", "req.req_key")[0]
        raw = bytearray(f.read_bytes())
        raw[4:8] = (0x7FFFFFFF).to_bytes(4, "little")
        f.write_bytes(bytes(raw))

    add("blosc_header_claims_2GiB", ("req_key", "2147483647"), blosc_lies)
    add(
        "offsets_not_monotonic",
        ("offsets", "CSR"),
        lambda t: _set_values(t, "target", "offsets", (5, 1), 0),
    )

    def offsets_float(t: Path) -> None:
        f = t / "rank0" / "verify" / "offsets" / "zarr.json"
        _edit_json(f, lambda m: m.update(data_type="float64"))

    add("offsets_dtype_float64", ("offsets", "int64"), offsets_float)
    add(
        "schema_version_99",
        ("schema version 99",),
        lambda t: _edit_json(
            t / "zarr.json", lambda m: m["attributes"]["hstrace"].update(schema_version=99)
        ),
    )
    add(
        "root_metadata_deleted",
        ("zarr",),
        lambda t: (t / "zarr.json").unlink(),
    )
    add(
        "commit_record_not_an_object",
        ("commit record",),
        lambda t: _rank_meta(t)(lambda m: m.update(commit=[1, 2, 3])),
    )
    add(
        "errors_not_a_list",
        ("errors",),
        lambda t: _rank_meta(t)(lambda m: m.update(errors="boom")),
    )
    add(
        "step_index_negative",
        ("step_index", "negative"),
        lambda t: _set_values(t, "draft_step", "step.step_index", 0, -4),
    )
    return cases


# --- issue 24 item 2: corrupt or impossible values, one generator per class ---------------


def _trace_case(d: Path, name: str, words, make, commands=TRACE_COMMANDS) -> Case:
    t = _copy_clean(d, name)
    make(t)
    return Case(name, t, "trace", tuple(words), tuple(commands))


def _root_meta(t: Path):
    return lambda edit: _edit_json(t / "zarr.json", lambda m: edit(m["attributes"]["hstrace"]))


def _array_meta(t: Path, table: str, array: str):
    return lambda edit: _edit_json(t / "rank0" / table / array / "zarr.json", edit)


def gen_metadata_types(d: Path) -> list[Case]:
    """Trace metadata of the wrong JSON type even when truthy or numeric: a boolean where a
    version or count belongs (`true` is a Python int), NaN, integers beyond int64, floats
    and strings where whole numbers belong, in the root, rank, static and column metadata."""
    big = 2**64
    edits = [
        (
            "meta_schema_version_true",
            ("schema version true",),
            "root",
            lambda m: m.update(schema_version=True),
        ),
        (
            "meta_commit_steps_float",
            ("verify.steps", "33.0"),
            "rank",
            lambda m: m["commit"]["tables"]["verify"].update(steps=33.0),
        ),
        (
            "meta_commit_steps_true",
            ("verify.steps", "true"),
            "rank",
            lambda m: m["commit"]["tables"]["verify"].update(steps=True),
        ),
        (
            "meta_commit_rows_beyond_int64",
            ("tok/input_ids", str(big), "int64"),
            "rank",
            lambda m: m["commit"]["tables"]["target"]["rows"].update({"tok/input_ids": big}),
        ),
        (
            "meta_clean_close_string",
            ("clean_close", "'no'"),
            "rank",
            lambda m: m["commit"].update(clean_close="no"),
        ),
        ("meta_rank_attribute_other_rank", ("rank", "3"), "rank", lambda m: m.update(rank=3)),
        (
            "meta_static_vocab_nan",
            ("target.vocab_size", "nan"),
            "root",
            lambda m: m["static"]["target"].update(vocab_size=float("nan")),
        ),
        (
            "meta_static_vocab_float",
            ("target.vocab_size", "512.5"),
            "root",
            lambda m: m["static"]["target"].update(vocab_size=512.5),
        ),
        (
            "meta_static_vocab_true",
            ("target.vocab_size", "true"),
            "root",
            lambda m: m["static"]["target"].update(vocab_size=True),
        ),
        (
            "meta_static_vocab_beyond_int64",
            ("target.vocab_size", "int64"),
            "root",
            lambda m: m["static"]["target"].update(vocab_size=big),
        ),
        (
            "meta_static_hidden_string",
            ("target.hidden_size", "'64'"),
            "root",
            lambda m: m["static"]["target"].update(hidden_size="64"),
        ),
        (
            "meta_static_aux_ids_strings",
            ("aux_layer_ids[0]", "'2'"),
            "root",
            lambda m: m["static"].update(aux_layer_ids=["2", "4", "5"]),
        ),
        (
            "meta_static_draft_vocab_inf",
            ("hot_token_id.size", "inf"),
            "root",
            lambda m: m["static"]["hot_token_id"].update(size=float("inf")),
        ),
    ]
    cases = []
    for name, words, where, edit in edits:
        cases.append(
            _trace_case(
                d,
                name,
                words,
                lambda t, w=where, e=edit: (_root_meta(t) if w == "root" else _rank_meta(t))(e),
            )
        )
    cases.append(
        _trace_case(
            d,
            "meta_column_layer_ids_float",
            ("aux_hidden", "layer_ids[0]", "2.0"),
            lambda t: _array_meta(t, "target", "tok.aux_hidden")(
                lambda m: m["attributes"].update(layer_ids=[2.0, 4, 5])
            ),
        )
    )
    return cases


def gen_clean_close_offsets(d: Path) -> list[Case]:
    """A cleanly closed trace whose offsets run past its rows, or end short of them, or whose
    step columns hold fewer rows than its steps: lowering the step count to what the rows
    cover is crash recovery; after a clean close it is corruption."""

    def rows(table: str, key: str, n: int):
        return lambda t: _rank_meta(t)(
            lambda m: m["commit"]["tables"][table]["rows"].update({key: n})
        )

    def offsets_end_short(t: Path) -> None:  # the last step's offsets back to the one before
        arr = zarr.open_array(str(t / "rank0" / "target" / "offsets"), mode="r+")
        data = arr[:]
        data[-1] = data[-2]
        arr[:] = data

    return [
        _trace_case(
            d,
            "clean_offsets_past_tok_rows",
            ("target", "closed cleanly", "41"),
            rows("target", "tok/input_ids", 300),
        ),
        _trace_case(
            d,
            "clean_offsets_past_proposed_rows",
            ("verify", "closed cleanly"),
            rows("verify", "proposed/ids", 90),
        ),
        _trace_case(
            d,
            "clean_step_rows_short",
            ("draft_step", "closed cleanly", "65"),
            rows("draft_step", "step/seq", 65),
        ),
        _trace_case(
            d,
            "clean_offsets_end_short_of_rows",
            ("target", "closed cleanly", "offsets end"),
            offsets_end_short,
        ),
    ]


def gen_unreadable_rank_group(d: Path) -> list[Case]:
    """A rank group whose metadata cannot be read (a symlink loop, a dangling link, a
    directory in its place): named, not reported as "ranks: none". (A rank directory with no
    `zarr.json` is a writer's claim whose group is not written yet: a trace still recording.)"""

    def loop(t: Path) -> None:
        f = t / "rank0" / "zarr.json"
        f.unlink()
        f.symlink_to("zarr.json")  # itself

    def dangling(t: Path) -> None:
        f = t / "rank0" / "zarr.json"
        f.unlink()
        f.symlink_to("gone.json")

    return [
        _trace_case(d, "rank_meta_symlink_loop", ("rank0/zarr.json",), loop),
        _trace_case(d, "rank_meta_dangling_link", ("rank0", "zarr.json"), dangling),
        _trace_case(
            d,
            "rank_meta_is_a_directory",
            ("rank0", "zarr.json", "not a file"),
            lambda t: ((t / "rank0" / "zarr.json").unlink(), (t / "rank0" / "zarr.json").mkdir()),
        ),
    ]


def gen_codecs(d: Path) -> list[Case]:
    """Codecs outside the schema's chain (bytes + blosc): an inserted transpose would decode
    scrambled rows as data, an extra checksum or another compressor is not what was written."""
    transpose = {"name": "transpose", "configuration": {"order": [1, 0]}}
    crc = {"name": "crc32c"}

    def codecs(table: str, array: str, edit):
        return lambda t: _array_meta(t, table, array)(lambda m: m.update(codecs=edit(m["codecs"])))

    return [
        _trace_case(
            d,
            "codec_transpose_inserted",
            ("aux_hidden", "transpose"),
            codecs("target", "tok.aux_hidden", lambda c: [transpose, *c]),
        ),
        _trace_case(
            d,
            "codec_crc32c_appended",
            ("n_tok", "crc32c"),
            codecs("target", "req.n_tok", lambda c: [*c, crc]),
        ),
        _trace_case(
            d,
            "codec_gzip_for_blosc",
            ("accept_len", "gzip"),
            codecs(
                "verify",
                "req.accept_len",
                lambda c: [c[0], {"name": "gzip", "configuration": {"level": 1}}],
            ),
        ),
    ]


def _reshard(t: Path, table: str, array: str, inner_rows: int, shard_rows: int) -> Path:
    """Rewrite one column of a trace in the sharded layout (the writer's for wide rows):
    inner chunks of `inner_rows`, shards of `shard_rows`, the same bytes + blosc chain."""
    from hstrace.trace.write.rowlog import COMPRESSORS

    path = t / "rank0" / table / array
    old = zarr.open_array(str(path), mode="r")
    data, attrs = old[:], dict(old.attrs)
    shutil.rmtree(path)
    new = zarr.create_array(
        str(path),
        shape=data.shape,
        chunks=(inner_rows, *data.shape[1:]),
        shards=(shard_rows, *data.shape[1:]),
        dtype=data.dtype,
        compressors=COMPRESSORS,
        fill_value=0,
        attributes=attrs,
        zarr_format=3,
    )
    new[:] = data
    return path / "c" / "0" / "0"


def _edit_shard_index(shard: Path, n_inner: int, edit) -> None:
    import google_crc32c

    raw = bytearray(shard.read_bytes())
    at = len(raw) - (16 * n_inner + 4)
    index = np.frombuffer(bytes(raw[at : at + 16 * n_inner]), "<u8").copy().reshape(-1, 2)
    edit(index)
    body = index.astype("<u8").tobytes()
    raw[at:] = body + np.uint32(google_crc32c.value(body)).astype("<u4").tobytes()
    shard.write_bytes(bytes(raw))


SHARD_INNER, SHARD_ROWS = 64, 512  # aux_hidden's 324 rows: one shard of 8 inner chunks


def gen_shard_aliasing(d: Path) -> list[Case]:
    """Shard index entries that alias another chunk's bytes (the same range twice, or ranges
    that overlap), with a valid checksum: one chunk's bytes would read as another's rows."""

    def alias(edit):
        def make(t: Path) -> None:
            shard = _reshard(t, "target", "tok.aux_hidden", SHARD_INNER, SHARD_ROWS)
            _edit_shard_index(shard, SHARD_ROWS // SHARD_INNER, edit)

        return make

    def same(ix: np.ndarray) -> None:
        ix[2] = ix[1]

    def overlap(ix: np.ndarray) -> None:
        ix[3, 0] = ix[2, 0] + 8

    # The commands that read the column's rows (replay reads every capture; diff compares it).
    return [
        _trace_case(
            d,
            "shard_index_alias_same_range",
            ("aux_hidden", "overlap"),
            alias(same),
            ("replay", "diff"),
        ),
        _trace_case(
            d,
            "shard_index_overlapping_ranges",
            ("aux_hidden", "overlap"),
            alias(overlap),
            ("replay", "diff"),
        ),
    ]


def gen_widths(d: Path) -> list[Case]:
    """Column widths that contradict the layout: an aux width that is no whole number of
    slots, a slot width other than the target's hidden size, a row shape other than the table
    declares. (How many slots arrived is evidence, not layout: an engine that skipped fc hands
    the drafter one slot, and replay names that fault.)"""
    aux = lambda t: _array_meta(t, "target", "tok.aux_hidden")  # noqa: E731

    def declared(t: Path) -> None:
        _edit_json(
            t / "rank0" / "target" / "zarr.json",
            lambda m: m["attributes"]["hstrace"]["columns"]["tok"]["aux_hidden"].update(
                row_shape=[190]
            ),
        )

    return [
        _trace_case(
            d,
            "width_slot_width_60",
            ("aux_hidden", "slot_width 60", "hidden_size 64"),
            lambda t: aux(t)(lambda m: m["attributes"].update(slot_width=60)),
        ),
        _trace_case(
            d,
            "width_not_whole_slots",
            ("aux_hidden", "192 wide", "whole number of slots of 60"),
            lambda t: (
                _root_meta(t)(lambda m: m["static"].pop("target")),
                aux(t)(lambda m: m["attributes"].update(slot_width=60)),
            ),
        ),
        _trace_case(
            d,
            "width_slot_not_hidden",
            ("slot_width 96", "hidden_size 64"),
            lambda t: aux(t)(lambda m: m["attributes"].update(layer_ids=[2, 4], slot_width=96)),
        ),
        _trace_case(d, "width_row_shape_declared_190", ("aux_hidden", "[192]", "[190]"), declared),
    ]


def gen_step_sequence(d: Path) -> list[Case]:
    """Duplicate or non-monotone step sequence numbers (`step/seq`), in several tables."""

    def seq(table: str, at: int, value):
        def make(t: Path) -> None:
            arr = zarr.open_array(str(t / "rank0" / table / "step.seq"), mode="r+")
            data = arr[:]
            data[at] = data[at - 1] if value == "dup" else value
            arr[:] = data

        return make

    # Read and checked when a table is opened: every reading command refuses them.
    cmds = TRACE_COMMANDS
    return [
        _trace_case(
            d,
            "seq_duplicate_target",
            ("target", "step/seq", "repeats", "step 5"),
            seq("target", 5, "dup"),
            cmds,
        ),
        _trace_case(
            d,
            "seq_backwards_draft_extend",
            ("draft_extend", "step/seq", "goes back"),
            seq("draft_extend", 7, 0),
            cmds,
        ),
        _trace_case(
            d, "seq_negative_verify", ("verify", "step/seq", "negative"), seq("verify", 0, -1), cmds
        ),
    ]


def gen_positions(d: Path) -> list[Case]:
    """Negative positions (named as such, not as missing rows)."""
    return [
        _trace_case(
            d,
            f"position_negative_{table}",
            (table, "tok/positions", "negative"),
            lambda t, tb=table: _set_values(t, tb, "tok.positions", 2, -5),
            cmds,
        )
        # replay reads the positions of target and draft_extend; diff and bundle all of them
        for table, cmds in (
            ("target", ("replay", "diff", "bundle")),
            ("draft_extend", ("replay", "diff", "bundle")),
            ("draft_step", ("diff", "bundle")),
        )
    ]


def gen_out_of_vocab_ids(d: Path) -> list[Case]:
    """Token ids at the vocabulary's end (512 of 512) in every id table replay reads,
    bonus ids too, and draft-vocab ids past the draft vocabulary (256)."""
    where = [
        ("target", "tok.input_ids", 4, 512),
        ("draft_extend", "tok.input_ids", 4, 512),
        ("draft_step", "tok.input_ids", 1, 512),
        ("requests", "tok.prompt_ids", 4, 512),
        # replay reads no verify ids (acceptance comes from counts); diff and bundle do
        ("verify", "req.bonus_id", 3, 512, ("diff", "bundle")),
        ("verify", "accepted.ids", 2, 512, ("diff", "bundle")),
        ("draft_extend", "tok.topk_draft_ids", (3, 0), 256),
    ]
    cases = []
    for table, array, at, value, *cmds in where:
        col = array.replace(".", "/")
        cases.append(
            _trace_case(
                d,
                f"oov_{table}_{array.replace('.', '_')}",
                (table, col, str(value), "vocabulary"),
                lambda t, tb=table, a=array, i=at, x=value: _set_values(t, tb, a, i, x),
                cmds[0] if cmds else ("replay", "diff", "bundle"),
            )
        )

    # No vocabulary in the trace's audit: replay checks every id it feeds its drafter (or maps
    # through its d2t) against the drafter's vocabularies (512 target, 256 draft) before use.
    def strip_vocab(t: Path) -> None:
        def strip(m: dict) -> None:
            for k in ("target", "draft_config", "hot_token_id"):
                m["attributes"]["hstrace"]["static"].pop(k, None)

        _edit_json(t / "zarr.json", strip)

    for table, array, at, value, what in (
        ("draft_extend", "tok.input_ids", 4, 600, "draft_extend input id 600"),
        ("draft_step", "tok.input_ids", 1, 600, "draft_step input id 600"),
        ("draft_extend", "tok.topk_draft_ids", (3, 0), 300, "draft_extend draft id 300"),
        ("draft_step", "tok.topk_draft_ids", (2, 0), 300, "draft_step draft id 300"),
    ):
        cases.append(
            _trace_case(
                d,
                f"oov_no_static_vocab_{table}_{array.replace('.', '_')}",
                (what, "vocabulary of"),
                lambda t, tb=table, a=array, i=at, x=value: (
                    strip_vocab(t),
                    _set_values(t, tb, a, i, x),
                ),
                ("replay",),
            )
        )
    return cases


def build_value_cases(d: Path) -> list[Case]:
    return [
        *gen_metadata_types(d),
        *gen_clean_close_offsets(d),
        *gen_unreadable_rank_group(d),
        *gen_codecs(d),
        *gen_shard_aliasing(d),
        *gen_widths(d),
        *gen_step_sequence(d),
        *gen_positions(d),
        *gen_out_of_vocab_ids(d),
    ]


def build_zip_cases(d: Path) -> list[Case]:
    cases: list[Case] = []
    members = sorted(f for f in CLEAN.rglob("*") if f.is_file())

    def base_zip(name: str) -> tuple[Path, zipfile.ZipFile]:
        z = d / f"{name}.zip"
        zf = zipfile.ZipFile(z, "w", compression=zipfile.ZIP_STORED)
        for f in members:
            zf.write(f, f.relative_to(CLEAN).as_posix())
        return z, zf

    # A member that inflates ~150x (under the per-member ratio limit) to far more than any
    # chunk of its array can hold: bounded by what the trace declares.
    z, zf = base_zip("zip_member_inflates_past_its_array")
    name = next(
        f.relative_to(CLEAN).as_posix()
        for f in members
        if "/verify/req.accept_len/c/" in f.as_posix()
    )
    zf.close()
    # Rewrite without that member, then add the bomb deflated.
    with zipfile.ZipFile(z) as src:
        keep = [(i, src.read(i)) for i in src.infolist() if i.filename != name]
    rng = np.random.default_rng(0)
    blob = bytearray(64 << 20)
    blob[::150] = rng.integers(0, 256, len(blob[::150]), dtype=np.uint8).tobytes()
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_STORED) as zf:
        for info, data in keep:
            zf.writestr(info, data)
        zf.writestr(name, bytes(blob), compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
        # Stored incompressible bytes keep the archive's total ratio under its limit, so the
        # bound that must catch this is the per-array one.
        zf.writestr("filler.bin", rng.integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    cases.append(
        Case(
            "zip_member_inflates_past_its_array", z, "zip", ("accept_len", "bytes"), TRACE_COMMANDS
        )
    )

    # Many extra members, each under the ratio limit, adding up far past what the trace is.
    z, zf = base_zip("zip_total_inflation")
    chunk = bytes(blob[: 16 << 20])
    for i in range(64):  # 1 GiB inflated from ~7 MB
        zf.writestr(f"junk/{i}", chunk, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
    zf.close()
    cases.append(Case("zip_total_inflation", z, "zip", ("inflate",), TRACE_COMMANDS))

    z, zf = base_zip("zip_symlink_member")
    info = zipfile.ZipInfo("rank0/notes")
    info.external_attr = 0o120777 << 16
    zf.writestr(info, "/etc/passwd")
    zf.close()
    cases.append(Case("zip_symlink_member", z, "zip", ("symlink",), TRACE_COMMANDS))

    z, zf = base_zip("zip_path_traversal")
    zf.writestr("../../outside.txt", "x")
    zf.close()
    cases.append(Case("zip_path_traversal", z, "zip", ("..",), TRACE_COMMANDS))

    z, zf = base_zip("zip_duplicate_member")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate we want
        zf.writestr("zarr.json", (CLEAN / "zarr.json").read_bytes())
    zf.close()
    cases.append(Case("zip_duplicate_member", z, "zip", ("twice",), TRACE_COMMANDS))

    # One member cut to half its bytes inside a well-formed zip (its CRC matches): the Blosc
    # frame's header promises bytes past the end, which numcodecs read out of bounds (a crash
    # before the guard compared the header with the member's size).
    z, zf = base_zip("zip_member_cut_short")
    zf.close()
    aux = next(
        f.relative_to(CLEAN).as_posix()
        for f in members
        if "/target/tok.aux_hidden/c/" in f.as_posix()
    )
    with zipfile.ZipFile(z) as src:
        keep = [(i.filename, src.read(i)) for i in src.infolist()]
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_STORED) as zf:
        for n, data in keep:
            zf.writestr(n, data[: len(data) // 2] if n == aux else data)
    cases.append(
        Case("zip_member_cut_short", z, "zip", ("aux_hidden", "truncated"), ("replay", "diff"))
    )

    z, zf = base_zip("zip_truncated")
    zf.close()
    data = z.read_bytes()
    z.write_bytes(data[: len(data) // 2])
    cases.append(Case("zip_truncated", z, "zip", ("zip_truncated.zip",), TRACE_COMMANDS))
    return cases


def build_training_cases(d: Path) -> list[Case]:
    cases: list[Case] = []
    argv = lambda p: {  # noqa: E731
        "replay": ["replay", str(CLEAN), "--against", str(p)],
        "check": ["check", str(DRAFTER), "--against", str(p)],
    }

    # SpecForge sample that inflates 1.5 GiB from ~1.5 MB: concatenated gzip members.
    sf = d / "specforge_gzip_bomb"
    shutil.copytree(WORLD / "training-specforge", sf)
    target = next((sf / "rows_0-48").glob("data_0.ckpt"))
    target.unlink()
    one = gzip.compress(bytes(1 << 20), compresslevel=9)
    with open(target.with_name("data_0.ckpt.gz"), "wb") as fh:
        for _ in range(1536):
            fh.write(one)
    cases.append(
        Case(
            "specforge_gzip_bomb",
            sf,
            "training",
            ("data_0.ckpt.gz", "inflates"),
            ("replay", "check"),
            argv(sf),
        )
    )

    # speculators v0.5: one sample's hidden width differs from the rest.
    sp = d / "speculators_width"
    shutil.copytree(TRAIN, sp)
    from safetensors.torch import load_file, save_file

    hs = sp / "hidden_states" / "hs_1.safetensors"  # the first sample agrees with the drafter
    tensors = load_file(str(hs))
    keys = sorted(tensors)
    import torch

    bad = {
        k: (torch.cat([v, v[..., :8]], dim=-1) if v.ndim >= 2 and v.is_floating_point() else v)
        for k, v in tensors.items()
    }
    save_file(bad, str(hs))
    del keys
    cases.append(
        Case(
            "speculators_hidden_width",
            sp,
            "training",
            ("hs_1.safetensors", "width"),
            ("replay", "check"),
            argv(sp),
        )
    )

    for name, make in (
        ("speculators_hs_fifo", lambda f: os.mkfifo(f)),
        ("speculators_hs_dev_zero", lambda f: f.symlink_to("/dev/zero")),
    ):
        p = d / name
        shutil.copytree(TRAIN, p)
        f = p / "hidden_states" / "hs_3.safetensors"
        f.unlink()
        make(f)
        cases.append(
            Case(
                name,
                p,
                "training",
                ("hs_3.safetensors", "not a regular file"),
                ("replay", "check"),
                argv(p),
            )
        )

    # A legacy .pt whose pickle would run a command: refused by weights_only, never executed.
    lg = d / "legacy_code_pickle"
    shutil.copytree(WORLD / "training-speculators-legacy", lg)
    marker = d / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import pickle

    (lg / "data_0.pt").write_bytes(pickle.dumps({"input_ids": Evil()}))  # checked: no PWNED
    cases.append(
        Case("legacy_code_pickle", lg, "training", ("data_0.pt",), ("replay", "check"), argv(lg))
    )

    tg = d / "specforge_truncated_gzip"
    shutil.copytree(WORLD / "training-specforge", tg)
    f = tg / "rows_0-48" / "data_0.ckpt"
    packed = gzip.compress(f.read_bytes())
    f.unlink()
    f.with_name("data_0.ckpt.gz").write_bytes(packed[: len(packed) // 2])
    cases.append(
        Case(
            "specforge_truncated_gzip",
            tg,
            "training",
            ("data_0.ckpt.gz",),
            ("replay", "check"),
            argv(tg),
        )
    )
    return cases


def build_drafter_cases(d: Path) -> list[Case]:
    cases: list[Case] = []
    argv = lambda p: {  # noqa: E731
        "check": ["check", str(p)],
        "replay": ["replay", str(CLEAN), "--against", str(TRAIN), "--drafter", str(p)],
    }
    big = d / "drafter_config_4TB"
    shutil.copytree(DRAFTER, big)
    _edit_json(
        big / "config.json",
        lambda m: m["transformer_layer_config"].update(hidden_size=65536, vocab_size=1 << 24),
    )
    cases.append(
        Case(
            "drafter_config_4TB",
            big,
            "drafter",
            ("hidden_size", "65536"),
            ("check", "replay"),
            argv(big),
        )
    )

    raw = d / "drafter_raw_pickle_bin"
    shutil.copytree(WORLD / "drafter-specforge", raw)
    (raw / "model.safetensors").unlink()
    import pickle

    (raw / "pytorch_model.bin").write_bytes(pickle.dumps({"fc.weight": [1.0, 2.0]}))
    cases.append(
        Case(
            "drafter_raw_pickle_bin",
            raw,
            "drafter",
            ("pytorch_model.bin",),
            ("check", "replay"),
            argv(raw),
        )
    )

    nj = d / "drafter_config_not_json"
    shutil.copytree(DRAFTER, nj)
    (nj / "config.json").write_text("{hidden_size: 64")
    cases.append(
        Case(
            "drafter_config_not_json",
            nj,
            "drafter",
            ("config.json", "JSON"),
            ("check", "replay"),
            argv(nj),
        )
    )

    tr = d / "drafter_truncated_safetensors"
    shutil.copytree(DRAFTER, tr)
    w = tr / "model.safetensors"
    w.write_bytes(w.read_bytes()[:5000])
    cases.append(
        Case(
            "drafter_truncated_safetensors",
            tr,
            "drafter",
            ("model.safetensors",),
            ("check", "replay"),
            argv(tr),
        )
    )

    for name, edit, words in (
        ("drafter_layers_1e6", {"num_hidden_layers": 10**6}, ("num_hidden_layers", "1000000")),
        ("drafter_hidden_negative", {"hidden_size": -64}, ("hidden_size", "-64")),
    ):
        p = d / name
        shutil.copytree(DRAFTER, p)
        _edit_json(p / "config.json", lambda m, e=edit: m["transformer_layer_config"].update(e))
        cases.append(Case(name, p, "drafter", words, ("check", "replay"), argv(p)))

    for name, make in (
        ("drafter_config_fifo", lambda f: os.mkfifo(f)),
        ("drafter_config_dev_zero", lambda f: f.symlink_to("/dev/zero")),
    ):
        p = d / name
        shutil.copytree(DRAFTER, p)
        (p / "config.json").unlink()
        make(p / "config.json")
        cases.append(
            Case(
                name,
                p,
                "drafter",
                ("config.json", "not a regular file"),
                ("check", "replay"),
                argv(p),
            )
        )

    vb = d / "drafter_vocab_2p24_only"  # only the vocab inflated: the embedding is saved
    shutil.copytree(DRAFTER, vb)
    _edit_json(
        vb / "config.json", lambda m: m["transformer_layer_config"].update(vocab_size=1 << 24)
    )
    cases.append(
        Case(
            "drafter_vocab_2p24_only",
            vb,
            "drafter",
            ("vocab_size", str(1 << 24)),
            ("check", "replay"),
            argv(vb),
        )
    )
    return cases


def _drafter_argv(p: Path) -> dict[str, list[str]]:
    return {
        "check": ["check", str(p)],
        "replay": ["replay", str(CLEAN), "--against", str(TRAIN), "--drafter", str(p)],
    }


def gen_drafter_config_values(d: Path) -> list[Case]:
    """Drafter config values of the wrong type or impossible: string or fractional sizes, NaN
    eps, -inf rope theta, zero heads, absurd or non-integer aux ids, a string flag, deep
    nesting. Each a named line, not "unexpected ZeroDivisionError / RecursionError"."""
    layer = "transformer_layer_config"
    edits = [
        (
            "drafter_hidden_size_string",
            (layer, "hidden_size", "'64'"),
            layer,
            {"hidden_size": "64"},
        ),
        (
            "drafter_intermediate_fraction",
            ("intermediate_size", "128.5"),
            layer,
            {"intermediate_size": 128.5},
        ),
        ("drafter_hidden_size_true", ("hidden_size", "True"), layer, {"hidden_size": True}),
        ("drafter_eps_nan", ("rms_norm_eps", "nan"), layer, {"rms_norm_eps": float("nan")}),
        (
            "drafter_rope_theta_minus_inf",
            ("rope_theta", "-inf"),
            layer,
            {"rope_theta": float("-inf")},
        ),
        ("drafter_zero_heads", ("num_attention_heads", "0"), layer, {"num_attention_heads": 0}),
        ("drafter_zero_kv_heads", ("num_key_value_heads", "0"), layer, {"num_key_value_heads": 0}),
        (
            "drafter_aux_id_absurd",
            ("eagle_aux_hidden_state_layer_ids[2]", str(10**12)),
            None,
            {"eagle_aux_hidden_state_layer_ids": [2, 4, 10**12]},
        ),
        (
            "drafter_aux_id_fraction",
            ("eagle_aux_hidden_state_layer_ids[1]", "4.5"),
            None,
            {"eagle_aux_hidden_state_layer_ids": [2, 4.5, 5]},
        ),
        (
            "drafter_aux_ids_string",
            ("eagle_aux_hidden_state_layer_ids", "'2,4,5'"),
            None,
            {"eagle_aux_hidden_state_layer_ids": "2,4,5"},
        ),
        (
            "drafter_flag_string",
            ("norm_before_residual", "'false'"),
            None,
            {"norm_before_residual": "false"},
        ),
        (
            "drafter_draft_vocab_float",
            ("draft_vocab_size", "256.0"),
            None,
            {"draft_vocab_size": 256.0},
        ),
    ]
    cases = []
    for name, words, level, edit in edits:
        p = d / name
        shutil.copytree(DRAFTER, p)
        _edit_json(
            p / "config.json",
            lambda m, lv=level, e=edit: (m[lv] if lv else m).update(e),
        )
        cases.append(Case(name, p, "drafter", words, ("check", "replay"), _drafter_argv(p)))
    p = d / "drafter_config_deep_nesting"
    shutil.copytree(DRAFTER, p)
    (p / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    cases.append(
        Case(p.name, p, "drafter", ("config.json", "nested"), ("check", "replay"), _drafter_argv(p))
    )
    return cases


def gen_drafter_weights(d: Path) -> list[Case]:
    """NaN/Inf weights (exit 0 before) and a `d2t` whose values fit no reading of the target
    vocabulary (corrupt, not `d2t-direct-table`)."""
    from safetensors.torch import load_file, save_file

    def edit(name: str, fn) -> Path:
        p = d / name
        shutil.copytree(DRAFTER, p)
        w = p / "model.safetensors"
        sd = load_file(str(w))
        fn(sd)
        save_file(sd, str(w), metadata={"format": "pt"})
        return p

    def put(key: str, index, value):
        def fn(sd) -> None:
            t = sd[key].clone()
            t.view(-1)[index] = value
            sd[key] = t

        return fn

    cases = []
    for name, words, fn in (
        ("drafter_weight_nan", ("fc.weight", "nan"), put("fc.weight", 7, float("nan"))),
        ("drafter_weight_inf", ("lm_head.weight", "inf"), put("lm_head.weight", 3, float("inf"))),
        ("drafter_d2t_past_vocab", ("d2t[5]", "1000000", "vocabulary"), put("d2t", 5, 10**6)),
        ("drafter_d2t_negative", ("d2t[0]", "-3", "vocabulary"), put("d2t", 0, -3)),
    ):
        p = edit(name, fn)
        cases.append(Case(name, p, "drafter", words, ("check", "replay"), _drafter_argv(p)))
    return cases


def _training_argv(p: Path) -> dict[str, list[str]]:
    return {
        "replay": ["replay", str(CLEAN), "--against", str(p)],
        "check": ["check", str(DRAFTER), "--against", str(p)],
    }


def gen_training_values(d: Path) -> list[Case]:
    """Training data: NaN/Inf hidden states, an empty dataset, token ids out of the vocabulary
    (the drafter's: 512) or negative."""
    import torch
    from safetensors.torch import load_file, save_file

    cases = []

    def speculators(name: str, words, fn) -> None:
        p = d / name
        shutil.copytree(TRAIN, p)
        fn(p)
        cases.append(Case(name, p, "training", words, ("replay", "check"), _training_argv(p)))

    def hs_value(value):
        def fn(p: Path) -> None:
            f = p / "hidden_states" / "hs_2.safetensors"
            t = load_file(str(f))
            hs = t["hidden_states"].clone()
            hs[5, 0, 3] = value
            t["hidden_states"] = hs
            save_file(t, str(f))

        return fn

    def empty(p: Path) -> None:
        import pyarrow as pa

        f = next(p.glob("data-*.arrow"))
        with pa.memory_map(str(f)) as src:
            table = pa.ipc.open_stream(src).read_all()
        with pa.OSFile(str(f), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table.slice(0, 0))
        shutil.rmtree(p / "hidden_states")
        (p / "hidden_states").mkdir()
        (p / "hidden_states" / "hs_0.safetensors").write_bytes(
            (TRAIN / "hidden_states" / "hs_0.safetensors").read_bytes()
        )

    speculators(
        "training_hidden_nan", ("hs_2.safetensors", "NaN", "token 5"), hs_value(float("nan"))
    )
    speculators("training_hidden_inf", ("hs_2.safetensors", "infinity"), hs_value(float("inf")))
    speculators("training_empty_dataset", ("no samples",), empty)

    def specforge(name: str, words, key: str, value) -> None:
        p = d / name
        shutil.copytree(WORLD / "training-specforge", p)
        f = p / "rows_0-48" / "data_3.ckpt"
        data = torch.load(f, weights_only=True)
        t = data[key].clone()
        t.view(-1)[6] = value
        data[key] = t
        torch.save(data, f)
        cases.append(Case(name, p, "training", words, ("replay", "check"), _training_argv(p)))

    specforge(
        "training_id_past_vocab",
        ("data_3.ckpt", "input_ids[6]", "512", "vocabulary"),
        "input_ids",
        512,
    )
    specforge(
        "training_id_negative", ("data_3.ckpt", "input_ids[6]", "-2", "negative"), "input_ids", -2
    )
    specforge("training_aux_nan", ("data_3.ckpt", "NaN"), "aux_hidden_state", float("nan"))
    return cases


def _argv(case: Case, command: str, out: Path) -> list[str]:
    if command in case.argv:
        return case.argv[command]
    p = str(case.path)
    return {
        "show": ["show", p],
        "replay": ["replay", p, "--against", str(TRAIN)],
        "diff": ["diff", str(CLEAN), p],
        "report": ["report", p, "--html", str(out / f"{case.name}.html")],
        "bundle": ["bundle", p, "-o", str(out / f"{case.name}.zip")],
    }[command]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    out = d / "out"
    out.mkdir()
    cases = [
        *build_trace_cases(d),
        *build_value_cases(d),
        *build_zip_cases(d),
        *build_training_cases(d),
        *gen_training_values(d),
        *build_drafter_cases(d),
        *gen_drafter_config_values(d),
        *gen_drafter_weights(d),
    ]
    only = [w for w in os.environ.get("HOSTILE_ONLY", "").split(",") if w]  # while developing
    if only:
        cases = [c for c in cases if any(w in c.name for w in only)]
    controls = build_controls(d)
    jobs = [
        {
            "id": f"{c.name}:{cmd}",
            "argv": _argv(c, cmd, out),
            "timeout_s": TIMEOUT_S,
            "mem_mb": MEM_MB,
        }
        for c in [*controls, *cases]
        for cmd in c.commands
    ]
    before = _digest(CLEAN)
    (d / "cases.json").write_text(json.dumps(jobs))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    env.pop("HSTRACE_DEBUG", None)
    subprocess.run(
        [sys.executable, str(RUNNER), str(d / "cases.json"), str(d / "results.json")],
        check=True,
        cwd=ROOT,
        env=env,
        timeout=TIMEOUT_S * len(jobs) + 120,
    )
    results = {r["id"]: r for r in json.loads((d / "results.json").read_text())}
    assert _digest(CLEAN) == before, "a reading command modified the trace it read"
    assert not (d / "PWNED").exists(), "a pickle in the training data ran code"
    return {c.name: c for c in cases}, results, {c.name: c for c in controls}


def _digest(tree: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in sorted(tree.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(tree).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def build_controls(d: Path) -> list[Case]:
    """Good inputs through the same runner and the same guards: a clean trace, its zip and the
    tiny world replay clean (exit 0), so no check above is a false alarm on real data."""
    t = _copy_clean(d, "control")
    z = d / "control.zip"
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_STORED) as zf:
        for f in sorted(CLEAN.rglob("*")):
            if f.is_file():
                zf.write(f, f.relative_to(CLEAN).as_posix())
    sf = {
        "replay": ["replay", str(CLEAN), "--against", str(WORLD / "training-specforge")],
        "check": ["check", str(DRAFTER), "--against", str(TRAIN)],
    }
    # The same trace with its capture column in the sharded layout: the codec-chain and
    # shard-index checks pass a clean shard.
    sh = _copy_clean(d, "control_sharded")
    _reshard(sh, "target", "tok.aux_hidden", SHARD_INNER, SHARD_ROWS)
    return [
        Case("control_trace", t, "trace", (), TRACE_COMMANDS),
        Case("control_sharded", sh, "trace", (), TRACE_COMMANDS),
        Case("control_zip", z, "zip", (), ("show", "replay", "diff", "report")),
        Case("control_training", TRAIN, "training", (), ("replay", "check"), sf),
    ]


def _problems(case: Case, command: str, r: dict) -> list[str]:
    out: list[str] = []
    if r["signal"] is not None:
        why = "ran past its time limit" if r["signal"] == 14 else f"killed by signal {r['signal']}"
        out.append(why)
    elif r["rc"] != 2:
        out.append(f"exit {r['rc']}, not 2")
    err = r["stderr"].strip()
    lines = err.splitlines()
    if "Traceback" in err:
        out.append("printed a traceback")
    if len(lines) != 1 or not lines[0].startswith("hstrace: error: "):
        out.append(f"stderr is not one 'hstrace: error:' line: {err[:300]!r}")
    elif "unexpected" in lines[0]:
        out.append(f"generic message: {lines[0][:200]!r}")
    else:
        missing = [w for w in case.words if w.lower() not in lines[0].lower()]
        if missing:
            out.append(f"message does not name {missing}: {lines[0][:300]!r}")
    if r["rss_mb"] - r["base_rss_mb"] > MEM_MB:
        out.append(f"peak RSS grew {r['rss_mb'] - r['base_rss_mb']:.0f} MB")
    return out


def test_good_inputs_pass_the_same_guards(runs):
    _, results, controls = runs
    bad = []
    for case in controls.values():
        for command in case.commands:
            r = results[f"{case.name}:{command}"]
            if r["rc"] != 0 or "hstrace: error" in r["stderr"] or "Traceback" in r["stderr"]:
                bad.append(f"{case.name} / {command}: exit {r['rc']}: {r['stderr'][-300:]!r}")
    assert not bad, "\n".join(bad)


def test_every_hostile_input_is_refused_with_one_named_line(runs):
    cases, results, _ = runs
    failures = []
    for case in cases.values():
        for command in case.commands:
            r = results[f"{case.name}:{command}"]
            for p in _problems(case, command, r):
                failures.append(f"{case.name} / {command}: {p}")
    assert not failures, f"{len(failures)} problems:\n" + "\n".join(failures)


def test_enough_hostile_runs(runs):
    """The README's figure: every (input, command) pair above is one bad input handled."""
    cases, results, controls = runs
    results = {k: r for k, r in results.items() if k.split(":")[0] not in controls}
    if not os.environ.get("HOSTILE_ONLY"):
        assert len(cases) >= 126 and len(results) >= 464, (len(cases), len(results))
