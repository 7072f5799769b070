"""What picks the CPU kernels a world is built with, for its MANIFEST (every world's build.py).

torch's `cpu_capability` names one ATen level ("AVX512"), but MKL and oneDNN choose their
kernels, hence a matmul's summation order and the bits of every trained weight, by finer CPU
features: two AVX-512 hosts, one with AMX and AVX512-FP16 and one without, rebuild the same world
with other bits. A rebuild is compared bit for bit only where this matches the committed
MANIFEST's (tests/helpers/worlds.py: same_kernels); elsewhere numerically.
"""

from __future__ import annotations

FEATURES = ("avx2", "avx512", "vnni", "avx512_bf16", "amx_tile", "amx_fp16")


def cpu_kernels() -> dict[str, object]:
    import torch

    def has(feature: str) -> bool | None:
        probe = getattr(torch.cpu, f"_is_{feature}_supported", None)
        return bool(probe()) if probe is not None else None

    vendor = ""
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), ""
            )
    except OSError:
        pass
    return {"vendor": vendor, **{feature: has(feature) for feature in FEATURES}}
