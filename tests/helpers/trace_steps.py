"""A deterministic ragged run of `target` steps and its check, for the writer's tests (crash,
write faults, sinks) and the producer scripts they start (which import this module with
tests/ on PYTHONPATH, `SCRIPT_ENV`)."""

from __future__ import annotations

import os

import numpy as np
import torch

from hstrace.trace import open_trace

WIDTH = 96
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_env() -> dict[str, str]:
    """The environment for a producer script that imports `helpers.trace_steps`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS_DIR, env.get("PYTHONPATH")]))
    return env


def step_data(s: int) -> dict:
    """Step s of a deterministic ragged run: decodes of 1-16 tokens, a 3000-token prefill every 40."""
    n = 3000 if s % 40 == 7 else 1 + (s * 7) % 16
    g = torch.Generator().manual_seed(s)
    return dict(
        step={"mode": int(n > 16)},
        req={"req_key": torch.tensor([s, s + 1]), "n_tok": torch.tensor([n // 2, n - n // 2])},
        tok={
            "input_ids": torch.arange(s, s + n, dtype=torch.int32),
            "positions": torch.arange(n, dtype=torch.int32),
            "aux_hidden": torch.randn(n, WIDTH, generator=g).to(torch.bfloat16),
        },
    )


def verify_prefix(path, rank: int = 0) -> int:
    """Every committed step equals what was written for it; returns the committed step count."""
    with open_trace(path) as tr:
        t = tr.rank(rank).table("target")
        if t is None:
            return 0
        seq = t.column("step", "seq")
        assert list(seq) == list(range(t.num_steps)), "committed steps have holes"
        mode = t.column("step", "mode")
        aux = t.column("tok", "aux_hidden").view(torch.int16).numpy()
        ids = t.column("tok", "input_ids")
        keys = t.column("req", "req_key")
        off_tok, off_req = t.offsets("tok"), t.offsets("req")
        for s in range(t.num_steps):
            want = step_data(s)
            a, b = off_tok[s], off_tok[s + 1]
            assert mode[s] == want["step"]["mode"]
            assert np.array_equal(keys[off_req[s] : off_req[s + 1]], want["req"]["req_key"].numpy())
            assert np.array_equal(ids[a:b], want["tok"]["input_ids"].numpy()), f"step {s} ids"
            assert np.array_equal(aux[a:b], want["tok"]["aux_hidden"].view(torch.int16).numpy()), (
                f"step {s} aux"
            )
        return t.num_steps
