"""`hstrace bundle`: real traces in, real zips out, read back through `open_trace`."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.cli import run_cli, run_main
from helpers.demo_trace import H, K

from hstrace.bundle import BundleOptions, bundle_info, check_zip, hash_token_ids, make_bundle
from hstrace.errors import TraceError
from hstrace.redaction import SKETCH_DIM, slot_statistics
from hstrace.trace import open_trace, request_key


@pytest.fixture(scope="module")
def demo(demo_trace) -> Path:
    return demo_trace(rounds=8)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))
    return np.array_equal(np.asarray(a), np.asarray(b))


def test_full_bundle_round_trips_bit_exact(demo, tmp_path):
    res = make_bundle(demo, tmp_path / "b.zip", BundleOptions())
    src, got = open_trace(demo), open_trace(res.path)
    assert got.ranks == src.ranks
    for name in src.rank(0).tables:
        ts, tg = src.rank(0).table(name), got.rank(0).table(name)
        assert tg.num_steps == ts.num_steps
        for axis, cols in ts.columns.items():
            for col in cols:
                if col == "t_ns":
                    continue
                assert _same(ts.column(axis, col), tg.column(axis, col)), f"{name}/{axis}/{col}"
    # layer ids / slot widths travel with the data
    attrs = got.rank(0).table("target").column_attrs("tok", "aux_hidden")
    assert attrs["slot_width"] == H and attrs["layer_ids"] == [1, 4, 7]
    info = bundle_info(res.path)
    man = info["manifest"]
    assert man["format"] == "hstrace-bundle" and man["versions"]["zarr"]
    assert "Replay was not run" in info["report"]
    assert info["reproduce"].startswith("hstrace replay b.zip")
    # every member but the manifest is hashed, and the hashes match
    import hashlib

    with zipfile.ZipFile(res.path) as zf:
        names = set(zf.namelist()) - {"hstrace-bundle/manifest.json"}
        assert names == set(man["members"])
        for n in list(names)[:40]:
            assert hashlib.sha256(zf.read(n)).hexdigest() == man["members"][n]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())


def test_steps_keep_whole_engine_steps(demo, tmp_path):
    res = make_bundle(demo, tmp_path / "s.zip", BundleOptions(steps="2:5"))
    assert res.engine_steps[0] == [2, 3, 4]
    src, got = open_trace(demo).rank(0), open_trace(res.path).rank(0)
    assert got.table("target").num_steps == 3
    assert got.table("draft_step").num_steps == 3 * 3
    for i, s in enumerate([2, 3, 4]):
        a, b = src.table("target").step(s), got.table("target").step(i)
        assert _same(a["tok"]["aux_hidden"], b["tok"]["aux_hidden"])
        assert _same(a["tok"]["input_ids"], b["tok"]["input_ids"])
    assert got.table("requests").num_steps == 1  # prompts kept for alignment


def test_requests_keep_only_their_rows(demo, tmp_path):
    res = make_bundle(demo, tmp_path / "r.zip", BundleOptions(requests="req-1"))
    src, got = open_trace(demo).rank(0), open_trace(res.path).rank(0)
    key = request_key("req-1")
    for name in ("target", "verify", "draft_extend", "requests"):
        assert set(np.asarray(got.table(name).column("req", "req_key")).tolist()) == {key}
    ts, tg = src.table("target"), got.table("target")
    for s in range(ts.num_steps):
        step = ts.step(s)
        keys = np.asarray(step["req"]["req_key"])
        n = np.asarray(step["req"]["n_tok"])
        i = int(np.flatnonzero(keys == key)[0])
        lo, hi = int(n[:i].sum()), int(n[: i + 1].sum())
        assert _same(step["tok"]["aux_hidden"][lo:hi], tg.step(s)["tok"]["aux_hidden"])
    v = got.table("verify")
    assert v.num_rows("accepted") == int(np.asarray(v.column("req", "n_accepted")).sum())


@pytest.mark.slow
def test_max_size_drops_steps_never_truncates(demo, tmp_path):
    full = make_bundle(demo, tmp_path / "full.zip", BundleOptions())
    one = make_bundle(demo, tmp_path / "one.zip", BundleOptions(steps="0"))
    limit = (one.size + full.size) // 2  # a small trace is mostly fixed overhead
    res = make_bundle(demo, tmp_path / "m.zip", BundleOptions(max_size=limit))
    assert res.size <= limit < full.size
    kept = res.engine_steps[0]
    assert 1 <= len(kept) < full.total_engine_steps[0] and kept == list(range(len(kept)))
    src, got = open_trace(demo).rank(0), open_trace(res.path).rank(0)
    for s in range(got.table("target").num_steps):  # each kept step whole and equal
        assert _same(
            src.table("target").step(s)["tok"]["aux_hidden"],
            got.table("target").step(s)["tok"]["aux_hidden"],
        )
    out = run_main("bundle", str(demo), "-o", str(tmp_path / "tiny.zip"), "--max-size", "2kB")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "--max-size" in out.stderr


def test_redact_ids_is_a_consistent_salted_hash(demo, tmp_path):
    salt_file = tmp_path / "salt"
    salt_file.write_bytes(b"0123456789abcdef0123")
    out = run_main(
        "bundle",
        str(demo),
        "-o",
        str(tmp_path / "ids.zip"),
        "--redact",
        "ids",
        "--salt-file",
        str(salt_file),
    )
    assert out.returncode == 0, out.stderr
    src, got = open_trace(demo).rank(0), open_trace(tmp_path / "ids.zip").rank(0)
    salt = b"0123456789abcdef0123"
    s_ids = np.asarray(src.table("target").column("tok", "input_ids"))
    g_ids = np.asarray(got.table("target").column("tok", "input_ids"))
    assert not np.array_equal(s_ids, g_ids)
    assert np.array_equal(g_ids, hash_token_ids(s_ids, salt))  # training side: same salt, same map
    prompts = np.asarray(got.table("requests").column("tok", "prompt_ids"))
    assert np.array_equal(
        prompts, hash_token_ids(np.asarray(src.table("requests").column("tok", "prompt_ids")), salt)
    )
    # the prefill's input ids are the prompts, hashed the same way: alignment still works
    assert np.isin(prompts, g_ids).all()
    man = bundle_info(tmp_path / "ids.zip")["manifest"]
    assert man["redaction"]["modes"] == ["ids"] and len(man["redaction"]["salt_sha256"]) == 64
    assert salt.hex() not in json.dumps(man)
    # without --salt-file a fresh salt is written next to the zip, never into it
    out = run_main("bundle", str(demo), "-o", str(tmp_path / "ids2.zip"), "--redact", "ids")
    assert (
        out.returncode == 0
        and (tmp_path / "ids2.zip.salt").exists()
        and "hash_token_ids" in out.stdout
    )


def test_one_salt_rule_for_bundle_replay_and_training_side(demo, tmp_path):
    """A fresh `.salt` file holds the salt itself: passed back as --salt-file (bundle), found by
    replay's lookup and read with `read_salt` (training side), it is the same salt each time."""
    from hstrace.redaction import find_salt, read_salt, salt_digest

    first = make_bundle(demo, tmp_path / "a.zip", BundleOptions(redact=("ids",)))
    salt = read_salt(first.salt_written)
    digest = bundle_info(first.path)["manifest"]["redaction"]["salt_sha256"]
    assert salt_digest(salt) == digest
    again = make_bundle(demo, tmp_path / "b.zip", BundleOptions(redact=("ids",), salt=salt))
    assert bundle_info(again.path)["manifest"]["redaction"]["salt_sha256"] == digest
    a_ids = open_trace(first.path).rank(0).table("target").column("tok", "input_ids")
    b_ids = open_trace(again.path).rank(0).table("target").column("tok", "input_ids")
    assert np.array_equal(np.asarray(a_ids), np.asarray(b_ids))
    assert find_salt(first.path, None, digest) == (salt, first.salt_written)
    # a bundle made before the one rule hashed with the hex-decoded bytes of its salt file:
    # the recorded digest picks that reading, and only a digest may
    legacy = tmp_path / "legacy.salt"
    legacy.write_bytes(b"ab" * 16)
    assert find_salt(tmp_path / "x.zip", legacy, salt_digest(b"\xab" * 16))[0] == b"\xab" * 16
    assert read_salt(legacy) == b"ab" * 16


def test_redact_hidden_keeps_stats_and_fingerprints(demo, tmp_path):
    res = make_bundle(demo, tmp_path / "h.zip", BundleOptions(redact=("hidden",)))
    src, got = open_trace(demo).rank(0), open_trace(res.path).rank(0)
    cols = got.table("target").columns["tok"]
    assert "aux_hidden" not in cols and {"aux_hidden_stats", "aux_hidden_sketch"} <= set(cols)
    assert "hidden_in" not in got.table("draft_extend").columns["tok"]
    h = src.table("target").column("tok", "aux_hidden")
    stats, sketch = slot_statistics(h, H)
    assert torch.allclose(
        torch.from_numpy(np.asarray(got.table("target").column("tok", "aux_hidden_stats"))), stats
    )
    sk = torch.from_numpy(
        np.asarray(got.table("target").column("tok", "aux_hidden_sketch"))
    ).reshape(len(h), K, -1)
    full = h.float().reshape(len(h), K, H)
    # the sketch keeps which slot is which: cosine of sketches tracks cosine of the states
    cos_full = torch.nn.functional.cosine_similarity(full[:, 0], full[:, 2], dim=-1)
    cos_sk = torch.nn.functional.cosine_similarity(sk[:, 0], sk[:, 2], dim=-1)
    assert (cos_full - cos_sk).abs().mean() < 0.25
    # the fingerprint's width does not grow with the hidden size (it is what makes bundles small)
    assert sk.shape[-1] == SKETCH_DIM
    man = bundle_info(res.path)["manifest"]
    assert "target/tok/aux_hidden" in man["redaction"]["dropped_columns"]


def test_with_drafter_ships_files_and_hashes(demo, tmp_path):
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 64})
    )
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.ones(4, 12)}, str(d / "model.safetensors"))
    out = run_main(
        "bundle", str(demo), "-o", str(tmp_path / "d.zip"), "--drafter", str(d), "--with-drafter"
    )
    assert out.returncode == 0, out.stderr
    man = bundle_info(tmp_path / "d.zip")["manifest"]
    assert man["drafter"]["config"]["draft_vocab_size"] == 64 and man["drafter"]["included"]
    with zipfile.ZipFile(tmp_path / "d.zip") as zf:
        assert (
            zf.read("hstrace-bundle/drafter/model.safetensors")
            == (d / "model.safetensors").read_bytes()
        )
    assert open_trace(tmp_path / "d.zip").rank(0).table("target").num_steps == 9


def _zip_with(path: Path, name: str, data: bytes, compress=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compress) as zf:
        zf.writestr("zarr.json", b"{}")
        zf.writestr(name, data)
    return path


@pytest.mark.parametrize(
    "name", ["../evil.txt", "/etc/evil", "a/../../evil", "C:evil", "a\\..\\evil"]
)
def test_path_traversal_is_refused(tmp_path, name):
    z = _zip_with(tmp_path / "t.zip", name, b"x")
    with pytest.raises(TraceError, match="refusing"):
        check_zip(z)
    out = run_main("bundle", str(z), "-o", str(tmp_path / "o.zip"))
    assert (
        out.returncode == 2
        and "Traceback" not in out.stderr
        and len(out.stderr.strip().splitlines()) == 1
    )


def test_zip_bomb_and_truncation_are_refused(demo, tmp_path):
    bomb = _zip_with(tmp_path / "bomb.zip", "rank0/x", b"\0" * (20 << 20), zipfile.ZIP_DEFLATED)
    with pytest.raises(TraceError, match="zip bomb"):
        check_zip(bomb)
    with pytest.raises(TraceError, match="zip bomb"):
        check_zip(
            tmp_path / "b.zip" if False else _zip_with(tmp_path / "big.zip", "a", b"1" * 4096),
            max_total=1000,
        )
    good = make_bundle(demo, tmp_path / "g.zip", BundleOptions()).path
    cut = tmp_path / "cut.zip"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    # through a real interpreter (subprocess): exit 2, one line, no traceback
    out = run_cli("bundle", str(cut), "-o", str(tmp_path / "o.zip"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert str(cut) in out.stderr


@pytest.mark.parametrize("window", [1, 3, 64])
def test_windowed_steps_match_step_reads(demo, window):
    from hstrace.trace.stepcache import WindowedSteps

    view = open_trace(demo).rank(0)
    for name in view.tables:
        t = view.table(name)
        w = WindowedSteps(t, window=window)
        for s in [*range(t.num_steps), 0]:  # forwards, then a jump back
            a, b = t.step(s), w.step(s)
            assert a.keys() == b.keys()
            for axis in a:
                for col in a[axis]:
                    assert _same(a[axis][col], b[axis][col]), (name, s, axis, col)
