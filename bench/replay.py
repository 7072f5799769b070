"""Step-0 replay throughput on CPU at a realistic drafter size, side by side in one run.

    python bench/replay.py [--json] [--tokens 1024] [--reps 5] [--small | --kimi] [--device cuda]

Contenders, interleaved rep by rep on the same inputs (one sequence of --tokens rows):
- `hstrace`: what `hstrace replay` does per recorded row: the reference drafter's batched
  step-0 forward (`hstrace.reference.step0.step0_logits`, fp32, inference mode) and the
  comparison against the engine's top-k (top-k, log-probs at the engine's ids, no full-vocab
  softmax) — `hstrace.replay.compare.compare_topk`.
- `matmul-bound`: `torch.mm` on exactly the shapes of the drafter's matmuls (fc, q/k/v, o,
  gate/up/down, lm_head, and the attention score/value products): the same FLOPs with no
  norms, RoPE, softmax or masking. The bound hstrace's forward cannot beat.
- `speculators`: speculators 0.9.0 `Eagle3DraftModel.forward(ttt_steps=1)` on the same weights
  (tensors shared, not copied) and inputs (eager attention, as its tests run it on CPU).

Sizes (Llama-3-8B-class EAGLE-3 draft): hidden 4096, 3 aux slots of 4096, 32 heads / 8 KV
heads of 128, MLP 14336, draft vocab 32000, target vocab 128256. `--small` divides the
widths by 8 for a quick check. `--kimi`: a Kimi-K2.5-sized draft (issue 14 item 6: hidden
7168, 3 aux slots of 7168, draft vocab 32000, target vocab 163840; 56 heads / 8 KV heads of
128 and MLP 18432 are this bench's choice, a Llama-style EAGLE-3 layer at that width).
`--device cuda` runs every contender on the GPU (weights built there, timed between
synchronizes; peak memory is then the CUDA allocator's). Reports median seconds per forward, tokens/s, the ratios
(hstrace vs the matmul bound, hstrace vs speculators) and each contender's peak RSS above the
process's resting RSS (sampled every 2 ms), plus the whole process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from hstrace.drafter import DrafterConfig, Eagle3Drafter
from hstrace.reference.step0 import Step0Input, step0_logits
from hstrace.replay.compare import compare_topk

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class PeakRSS:
    """Peak resident set size while the block runs, sampled by a thread."""

    def __enter__(self) -> PeakRSS:
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def config(small: bool, kimi: bool = False) -> DrafterConfig:
    if kimi:
        return DrafterConfig(
            hidden_size=7168,
            vocab_size=163840,
            draft_vocab_size=32000,
            num_attention_heads=56,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=18432,
            num_aux=3,
            rope_theta=50000.0,
            rms_norm_eps=1e-5,
        )
    d = 8 if small else 1
    return DrafterConfig(
        hidden_size=4096 // d,
        vocab_size=128256 // d,
        draft_vocab_size=32000 // d,
        num_attention_heads=32 // d if small else 32,
        num_key_value_heads=8 // d if small else 8,
        head_dim=128,
        intermediate_size=14336 // d,
        num_aux=3,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    )


@contextmanager
def skip_init() -> Iterator[None]:
    """Allocate modules without their random init (a billion parameters take minutes to
    initialise on two cores); the bench fills or shares the weights itself."""
    names = ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "xavier_uniform_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda t, *a, **k: t)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def build(cfg: DrafterConfig, device: str = "cpu") -> Eagle3Drafter:
    torch.manual_seed(0)
    with skip_init(), torch.device(device):  # allocated where it runs (GB of weights)
        model = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        used = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
        model.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
        model.t2d.zero_()
        model.t2d[used] = True
    return model.eval()


def matmul_bound(cfg: DrafterConfig, T: int, device: str = "cpu") -> Callable[[], None]:
    """The drafter's matmuls as bare torch.mm / bmm on the same shapes."""
    H, n, Ht = cfg.hidden_size, cfg.num_aux, cfg.aux_width
    nh, nkv, hd, inter, Vd = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.hd,
        cfg.intermediate_size,
        cfg.draft_vocab_size,
    )
    g = torch.Generator(device=device).manual_seed(1)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device) * 0.02

    w = {
        "fc": r(n * Ht, H),
        "q": r(2 * H, nh * hd),
        "k": r(2 * H, nkv * hd),
        "v": r(2 * H, nkv * hd),
        "o": r(nh * hd, H),
        "gate": r(H, inter),
        "up": r(H, inter),
        "down": r(inter, H),
        "head": r(H, Vd),
    }
    aux, x2 = r(T, n * Ht), r(T, 2 * H)
    q, kt, v = r(nh, T, hd), r(nh, hd, T), r(nh, T, hd)

    def run() -> None:
        h = aux @ w["fc"]
        for name in ("q", "k", "v"):
            x2 @ w[name]
        p = torch.bmm(q, kt)  # scores, every head
        a = torch.bmm(p, v)
        h = a.transpose(0, 1).reshape(T, nh * hd) @ w["o"]
        z = h @ w["gate"]
        z = (h @ w["up"]) @ w["down"]
        z @ w["head"]

    return run


def speculators_forward(
    model: Eagle3Drafter, cfg: DrafterConfig, ids, aux, device: str = "cpu"
) -> Callable[[], None] | None:
    try:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    except ImportError:
        return None
    from hstrace.drafter.dialects import speculators_config

    raw = speculators_config(cfg, "float32")
    raw["transformer_layer_config"]["_attn_implementation"] = "eager"
    scfg = Eagle3SpeculatorConfig(**{k: v for k, v in raw.items() if k != "torch_dtype"})
    scfg.transformer_layer_config._attn_implementation = "eager"
    with skip_init():
        theirs = Eagle3DraftModel(scfg)
    # Share our tensors (no copy): the same weights, and no second 4 GB in memory.
    state = {k: v for k, v in model.state_dict().items() if k != "inv_freq"}
    _missing, unexpected = theirs.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise RuntimeError(f"speculators does not know keys {unexpected[:5]}")
    theirs.to(device).eval()  # its own buffers (rotary) where the shared weights are
    T = ids.shape[0]
    docs = torch.zeros(1, T, dtype=torch.long, device=device)

    def run() -> None:
        theirs(hidden_states=aux[None], input_ids=ids[None], document_ids=docs, ttt_steps=1)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--kimi", action="store_true", help="a Kimi-K2.5-sized draft (see above)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (every contender there)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.small and args.kimi:
        ap.error("--small and --kimi are two sizes: pick one")
    dev = args.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {dev}: torch sees no CUDA device here")
    cuda = dev.startswith("cuda")

    cfg = config(args.small, args.kimi)
    T = args.tokens
    model = build(cfg, dev)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g).to(dev)
    aux = torch.randn(T, cfg.num_aux * cfg.aux_width, generator=g).to(dev)
    item = [Step0Input(ids, aux, torch.arange(T, device=dev))]
    engine_ids = torch.randint(0, cfg.draft_vocab_size, (T, 8), generator=g).to(dev)
    engine_lp = torch.randn(T, 8, generator=g).to(dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def hstrace_step0() -> None:
        logits = step0_logits(model, item)[0]
        compare_topk(engine_ids, engine_lp, logits, None)

    contenders: dict[str, Callable[[], None]] = {
        "hstrace": hstrace_step0,
        "matmul-bound": matmul_bound(cfg, T, dev),
    }
    spec = None
    try:
        spec = speculators_forward(model, cfg, ids, aux, dev)
    except Exception as exc:  # noqa: BLE001 - reported, the other contenders still run
        print(f"speculators contender unavailable: {type(exc).__name__}: {exc}")
    if spec is not None:
        contenders["speculators"] = spec

    times: dict[str, list[float]] = {k: [] for k in contenders}
    peaks: dict[str, int] = dict.fromkeys(contenders, 0)
    with torch.inference_mode():
        for fn in contenders.values():  # warm-up (allocator, oneDNN primitives, kernels)
            fn()
        sync()
        for _ in range(args.reps):
            for name, fn in contenders.items():
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                with PeakRSS() as mem:
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    times[name].append(time.perf_counter() - t0)
                peak = torch.cuda.max_memory_allocated() - base if cuda else mem.peak - mem.base
                peaks[name] = max(peaks[name], peak)

    flops_per_token = 2 * (
        cfg.num_aux * cfg.aux_width * cfg.hidden_size
        + 2 * cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.hd
        + cfg.num_attention_heads * cfg.hd * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
        + cfg.hidden_size * cfg.draft_vocab_size
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "config": {
            "hidden": cfg.hidden_size,
            "aux_slots": cfg.num_aux,
            "draft_vocab": cfg.draft_vocab_size,
            "target_vocab": cfg.vocab_size,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "intermediate": cfg.intermediate_size,
            "tokens": T,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32 if cuda else None,
            "reps": args.reps,
        },
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "tokens_per_s": {k: round(T / v, 1) for k, v in med.items()},
        "gflops_per_s": {k: round(flops_per_token * T / v / 1e9, 1) for k, v in med.items()},
        "hstrace_vs_matmul_bound": round(med["matmul-bound"] / med["hstrace"], 3),
        "hstrace_vs_speculators": round(med["speculators"] / med["hstrace"], 3)
        if "speculators" in med
        else None,
        # CPU: peak RSS above the resting RSS; CUDA: peak allocated above what was allocated.
        "peak_rss_above_rest_mb": {k: round(v / 2**20, 1) for k, v in peaks.items()},
        "process_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "weights_mb": round(
            sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, 1
        ),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    c = result["config"]
    print(
        f"step-0 replay, hidden {c['hidden']}, {c['aux_slots']} aux slots, draft vocab "
        f"{c['draft_vocab']}, target vocab {c['target_vocab']}, {T} tokens, fp32, "
        f"{c['threads']} threads, median of {args.reps}"
    )
    for k in contenders:
        print(
            f"  {k:13s} {med[k]:8.3f} s  {T / med[k]:8.1f} tok/s  "
            f"{result['gflops_per_s'][k]:7.1f} GFLOP/s  peak +{result['peak_rss_above_rest_mb'][k]:.0f} MB"
        )
    print(
        f"  hstrace / matmul bound throughput: {result['hstrace_vs_matmul_bound']:.3f} (target >= 0.8)"
    )
    if result["hstrace_vs_speculators"] is not None:
        print(
            f"  hstrace / speculators throughput:  {result['hstrace_vs_speculators']:.3f} (target >= 1.0)"
        )
    print(
        f"  weights {result['weights_mb']:.0f} MB, process peak RSS {result['process_peak_rss_mb']:.0f} MB"
    )


if __name__ == "__main__":
    main()
