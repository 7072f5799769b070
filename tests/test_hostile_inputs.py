"""Hostile inputs against every reading command: nothing hangs, nothing blows up memory, nothing
lies (corrupt data is an error, not zeros), and every refusal is one named line.

Each hostile input is generated here from a good one (the committed clean example trace, the
tiny world's training dumps and drafters), then every reading command that takes it (`show`,
`replay`, `diff`, `report`, `bundle`, `check`) runs on it in its own forked process under an
address-space limit and an alarm (tests/hostile_runner.py). Every run must end with exit 2, one
line on stderr that starts with `hstrace: error:` and names the problem (the case's `words`), no
traceback, no warning printed first, within its time limit and memory budget.

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
    cases = (
        build_trace_cases(d) + build_zip_cases(d) + build_training_cases(d) + build_drafter_cases(d)
    )
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
    return [
        Case("control_trace", t, "trace", (), TRACE_COMMANDS),
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
        assert len(cases) >= 55 and len(results) >= 226, (len(cases), len(results))
