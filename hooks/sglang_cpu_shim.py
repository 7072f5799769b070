"""CPU stand-ins that let SGLang 0.5.23 serve EAGLE-3 (topk 1) on a machine without a GPU.

Test and demo infrastructure, never production: loaded only when `HSTRACE_SGLANG_CPU=1` (by
`hstrace.hooks.bootstrap`, from the generated `sitecustomize` or SGLang's plugin entry point),
and only for sglang 0.5.23 (any other version is refused: the pieces below replace code at
exact places of that release). Every piece replaces one CUDA/Triton-only kernel or backend and
nothing else; the target forward, the aux-state capture, the drafter forward, `hot_token_id`,
the scheduler and the EAGLE worker stay SGLang's own code (where the train/serve wiring faults
hstrace looks for live). Where each blocker sits: `shared/reference/sglang-cpu.md`.

The stand-ins (each class/function says which CUDA piece it replaces):
- `TorchvisionStandIn`: torchvision is imported unconditionally (multimodal configs); the
  released wheel needs a CUDA torch (`operator torchvision::nms does not exist` next to CPU torch).
- KV copy: `MHATokenToKVPool._init_kv_copy_and_warmup` launches a Triton kernel; on CPU the pool
  uses SGLang's own `move_kv_cache_native` instead.
- Tree build / verify dispatch: `spec_tree` picks the Triton-language wrappers (its XPU branch);
  the two kernels behind them are `TorchKernel` ports.
- Attention: `TorchNativeAttnBackend` serves TARGET_VERIFY and DRAFT_EXTEND_V2 (prefix from the
  pool + the new tokens, causal: equal to the tree mask because topk 1 makes the tree a chain),
  and a multi-step draft backend for torch_native (`TorchNativeMultiStepDraftBackend`).
- Five Triton bookkeeping kernels ported line by line to torch (`TorchKernel`), installed in place
  of the module-level kernel objects with the same `kernel[grid](...)` call form.
Scope: page size 1, no sliding window, no CUDA graphs (`--disable-cuda-graph` is implied on CPU),
`--speculative-eagle-topk 1`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any
from unittest.mock import MagicMock

from hstrace.hooks.common import patch_modules

ENV = "HSTRACE_SGLANG_CPU"
SUPPORTED = "0.5.23"
_state: dict[str, Any] = {"installed": False}


def wanted() -> bool:
    return os.environ.get(ENV, "") == "1"


def _sglang_version() -> str | None:
    from hstrace.engines.sglang.versions import SUPPORT

    return SUPPORT.installed_version()


def refuse(message: str) -> None:
    """One line and exit 2 before SGLang serves (hstrace.hooks.common.refuse, without a status file)."""
    from hstrace.hooks.common import refuse as refuse_with_status

    refuse_with_status({}, message)


def install_from_env() -> bool:
    """Install the stand-ins in this process when `HSTRACE_SGLANG_CPU=1` (idempotent)."""
    if not wanted() or _state["installed"]:
        return False
    found = _sglang_version()
    if found != SUPPORTED:
        refuse(
            f"{ENV}=1: hstrace's CPU shim is written for sglang {SUPPORTED} only, "
            f"and this Python has {found or 'no sglang'}; unset {ENV} or use sglang {SUPPORTED}"
        )
    install()
    return True


# ---- torchvision: an import-time stand-in --------------------------------------------------


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """CPU stand-in for torchvision, which SGLang imports unconditionally for multimodal configs
    (`srt/configs/__init__.py` -> internvl_utils) and a text-only server never calls; the released
    wheel fails to import next to CPU torch. Installed only when torchvision cannot be imported.
    Any attribute of a stand-in module is a MagicMock (enough for import-time use); `PREFIXES`
    names the top-level packages it serves (the tests' fakes reuse it for another package)."""

    PREFIXES: tuple[str, ...] = ("torchvision",)
    VERSION = "0.0.0+hstrace-cpu-stand-in"

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in self.PREFIXES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = self.VERSION
        return module

    def exec_module(self, module):
        return None


def _torchvision_importable() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:
        sys.modules.pop("torchvision", None)
        return False
    return True


# ---- the five Triton bookkeeping kernels, ported to torch ----------------------------------


class TorchKernel:
    """A torch port of one Triton kernel, called like the kernel: `kernel[grid](*args)`.

    `fn(grid, *args, **kwargs)` runs every program id of `grid` in order; pointers of the Triton
    source are flat views of the (contiguous) tensors, so pointer + offset is an index."""

    def __init__(self, name: str, fn: Callable[..., None]) -> None:
        self.name = name
        self.fn = fn
        self.__name__ = name
        self.hstrace_cpu_stand_in = True

    def __getitem__(self, grid):
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        return lambda *args, **kwargs: self.fn(grid, *args, **kwargs)

    def __repr__(self) -> str:
        return f"TorchKernel({self.name}: CPU stand-in for the Triton kernel)"


def _flat(t):
    if not t.is_contiguous():
        raise RuntimeError("hstrace CPU shim: a kernel argument is not contiguous")
    return t.view(-1)


def _assign_req_to_token_pool(
    grid, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len, *_
):
    """`mem_cache/allocation.py::assign_req_to_token_pool`: request pid's slots
    [start, end) take the next `end - start` entries of out_cache_loc."""
    out_offset = 0
    for pid in range(grid[0]):
        start, end = int(start_offset[pid]), int(end_offset[pid])
        row = int(req_pool_indices[pid])
        req_to_token[row, start:end] = out_cache_loc[out_offset : out_offset + end - start].to(
            req_to_token.dtype
        )
        out_offset += end - start


def _assign_draft_cache_locs_contiguous(
    grid,
    req_pool_indices,
    req_to_token,
    seq_lens,
    out_cache_loc,
    pool_len,
    topk,
    speculative_num_steps,
    positions=None,
    mrope=None,
    BS=0,  # noqa: N803 - the kernel's parameter name
    WRITE_POSITIONS=False,  # noqa: N803
    WRITE_MROPE=False,  # noqa: N803
):
    """`kernels/ops/speculative/cache_locs.py::assign_draft_cache_locs_contiguous`: copy each
    request's `topk * steps` slots from `seq_lens` on out of req_to_token."""
    copy_len = topk * speculative_num_steps
    out = _flat(out_cache_loc)
    for pid in range(grid[0]):
        kv_start = int(seq_lens[pid])
        row = req_to_token[int(req_pool_indices[pid])]
        out[pid * copy_len : (pid + 1) * copy_len] = row[kv_start : kv_start + copy_len].to(
            out.dtype
        )
        if WRITE_POSITIONS:
            _flat(positions)[pid * topk : pid * topk + topk] = kv_start
            if WRITE_MROPE:
                flat = _flat(mrope)
                for axis in range(3):
                    base = axis * BS * topk + pid * topk
                    flat[base : base + topk] = kv_start


def _fill_bonus_tokens(grid, accept_tokens, accept_lens, bonus_tokens_ptr, accept_stride):
    """`kernels/ops/speculative/eagle.py::fill_bonus_tokens`: the last accepted token per
    request (`accept_lens` includes the bonus)."""
    tokens, bonus = _flat(accept_tokens), _flat(bonus_tokens_ptr)
    for pid in range(grid[0]):
        bonus[pid] = tokens[accept_stride * pid + int(accept_lens[pid]) - 1]


def _build_tree_efficient(
    grid,
    parent_list_ptr,
    selected_index_ptr,
    verified_seq_len_ptr,
    seq_len_prefix_sum_ptr,
    tree_mask_ptr,
    positions_ptr,
    retrieve_index_ptr,
    retrieve_next_token_ptr,
    retrieve_next_sibling_ptr,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
    batch_size,
    parent_list_stride,
    selected_index_stride,
):
    """`kernels/ops/speculative/spec_tree.py::sgl_build_tree_kernel_efficient_triton`, line by
    line (one loop iteration per Triton program)."""
    parents, selected = _flat(parent_list_ptr), _flat(selected_index_ptr)
    mask, positions = _flat(tree_mask_ptr), _flat(positions_ptr)
    r_index, r_next = _flat(retrieve_index_ptr), _flat(retrieve_next_token_ptr)
    r_sibling = _flat(retrieve_next_sibling_ptr)
    ndt = draft_token_num
    for b in range(grid[0]):
        seq_len = int(verified_seq_len_ptr[b])
        seq_tree_idx = ndt * ndt * b + int(seq_len_prefix_sum_ptr[b]) * ndt
        positions[b * ndt] = seq_len
        base = b * ndt
        for i in range(ndt - 1, 0, -1):
            r_index[b * ndt + i] = base + i
            parent_tb_idx = int(selected[b * selected_index_stride + i - 1]) // topk
            parent_position, found = 0, parent_tb_idx == 0
            if not found:
                parent_token_idx = int(parents[b * parent_list_stride + parent_tb_idx])
                for pp in range(ndt - 1):
                    if int(selected[b * selected_index_stride + pp]) == parent_token_idx:
                        parent_position, found = pp + 1, True
                        break
            if found:
                addr = b * ndt + parent_position
                next_tok = int(r_next[addr])
                r_next[addr] = i
                if next_tok != -1:
                    r_sibling[b * ndt + i] = next_tok
        r_index[b * ndt] = base
        for x in range(ndt):
            if tree_mask_mode == 0:  # FULL_MASK
                tree_idx = seq_tree_idx + (seq_len + ndt) * x + seq_len + 1
            else:
                tree_idx = ndt * ndt * b + ndt * x + 1
            mask[tree_idx - 1] = 1
            mask[tree_idx : tree_idx + ndt - 1] = 0
            if x == 0:
                continue
            cur, position = x - 1, 0
            for _ in range(depth):
                position += 1
                mask[tree_idx + cur] = 1
                parent_tb_idx = int(selected[b * selected_index_stride + cur]) // topk
                if parent_tb_idx == 0:
                    break
                parent_token_idx = int(parents[b * parent_list_stride + parent_tb_idx])
                hit = [
                    cp
                    for cp in range(ndt - 1)
                    if int(selected[b * selected_index_stride + cp]) == parent_token_idx
                ]
                if not hit:
                    break
                cur = hit[0]
            positions[b * ndt + x] = position + seq_len


def _verify_tree_greedy(
    grid,
    predicts_ptr,
    accept_index_ptr,
    accept_token_num_ptr,
    candidates_ptr,
    retrieve_index_ptr,
    retrieve_next_token_ptr,
    retrieve_next_sibling_ptr,
    target_predict_ptr,
    batch_size,
    num_speculative_tokens,
    num_draft_tokens,
):
    """`kernels/ops/speculative/spec_tree.py::verify_tree_greedy_kernel_triton`: walk the tree
    from the root, accepting the child whose token equals the target's prediction."""
    predicts, accept_index = _flat(predicts_ptr), _flat(accept_index_ptr)
    accept_num, candidates = _flat(accept_token_num_ptr), _flat(candidates_ptr)
    r_index, r_next = _flat(retrieve_index_ptr), _flat(retrieve_next_token_ptr)
    r_sibling, target = _flat(retrieve_next_sibling_ptr), _flat(target_predict_ptr)
    ndt, nst = num_draft_tokens, num_speculative_tokens
    for bx in range(grid[0]):
        last = int(r_index[bx * ndt])
        accept_index[bx * nst] = last
        n_accept, cur = 0, 0
        for _ in range(1, nst):
            cur = int(r_next[bx * ndt + cur])
            target_token = int(target[(last // ndt) * ndt + last % ndt])
            matched = False
            while cur != -1:
                idx = bx * ndt + cur
                if int(candidates[idx]) == target_token:
                    draft_index = int(r_index[idx])
                    predicts[last] = target_token
                    n_accept += 1
                    accept_index[bx * nst + n_accept] = draft_index
                    last, matched = draft_index, True
                    break
                cur = int(r_sibling[idx])
            if not matched:
                break
        accept_num[bx] = n_accept
        predicts[last] = target[(last // ndt) * ndt + last % ndt]


KERNELS: dict[tuple[str, str], Callable[..., None]] = {
    ("sglang.srt.mem_cache.allocation", "assign_req_to_token_pool"): _assign_req_to_token_pool,
    (
        "sglang.kernels.ops.speculative.cache_locs",
        "assign_draft_cache_locs_contiguous",
    ): _assign_draft_cache_locs_contiguous,
    ("sglang.kernels.ops.speculative.eagle", "fill_bonus_tokens"): _fill_bonus_tokens,
    (
        "sglang.kernels.ops.speculative.spec_tree",
        "sgl_build_tree_kernel_efficient_triton",
    ): _build_tree_efficient,
    (
        "sglang.kernels.ops.speculative.spec_tree",
        "verify_tree_greedy_kernel_triton",
    ): _verify_tree_greedy,
}


# ---- patches applied right after SGLang's modules execute ----------------------------------


def _patch_memory_pool(module: Any) -> None:
    """KV copy: the Triton tiled copy (`copy_all_layer_kv_cache_tiled`) is replaced by SGLang's
    own native move (`move_kv_cache_native`), which `use_native_move_kv_cache` selects."""

    def _init_kv_copy_and_warmup(self) -> None:  # CPU stand-in: no Triton warm-up
        self._kv_copy_config = None
        self.use_native_move_kv_cache = True

    _init_kv_copy_and_warmup.hstrace_cpu_stand_in = True  # type: ignore[attr-defined]
    module.MHATokenToKVPool._init_kv_copy_and_warmup = _init_kv_copy_and_warmup


def _patch_spec_tree(module: Any) -> None:
    """Tree build/verify dispatch: take the Triton-language wrappers (SGLang's XPU branch), whose
    kernels are the torch ports; the CUDA branch needs sgl_kernel's compiled ops."""
    module._is_xpu = True


def _patch_torch_native(module: Any) -> None:
    """Attention for the speculative forward modes, which torch_native does not serve."""
    cls = module.TorchNativeAttnBackend
    original = cls.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        mode = forward_batch.forward_mode
        if not (mode.is_target_verify() or mode.is_draft_extend_v2()):
            return original(self, q, k, v, layer, forward_batch, save_kv_cache)
        # Both modes run `n` new tokens per request after a cached prefix whose slots, and the
        # new tokens' slots, are in req_to_token. TARGET_VERIFY: seq_lens is the prefix.
        # DRAFT_EXTEND_V2: seq_lens already counts the new tokens. Causal over the new tokens
        # equals the tree mask only for a chain, i.e. topk 1 (refused otherwise).
        import torch

        fb = forward_batch
        bs = int(fb.batch_size)
        n = q.shape[0] // bs
        if n * bs != q.shape[0]:
            raise RuntimeError("hstrace CPU shim: uneven tokens per request in a spec forward")
        saved = (fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens)
        new = torch.full_like(fb.seq_lens, n)
        if mode.is_target_verify():
            prefix, total = fb.seq_lens, fb.seq_lens + n
        else:
            prefix, total = fb.seq_lens - n, fb.seq_lens
        fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens = total, prefix, new
        try:
            return original(self, q, k, v, layer, fb, save_kv_cache)
        finally:
            fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens = saved

    forward_extend.hstrace_cpu_stand_in = True  # type: ignore[attr-defined]
    cls.forward_extend = forward_extend

    class TorchNativeDraftStepBackend(cls):
        """Draft decode step `step` of the multi-step draft (CPU stand-in for a Triton/FlashInfer
        per-step backend): the query at position seq_len + step attends the prefix plus draft
        slots 0..step, which `assign_draft_cache_locs` took from req_to_token[seq_len:]."""

        def __init__(self, model_runner, step: int) -> None:
            super().__init__(model_runner)
            self.step = step

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            saved = forward_batch.seq_lens
            forward_batch.seq_lens = saved + self.step + 1
            try:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens = saved

    class TorchNativeMultiStepDraftBackend:
        """CPU stand-in for `TritonMultiStepDraftBackend`: one torch_native backend per draft
        step (`num_steps - 1` forwards), topk 1 only."""

        needs_cpu_seq_lens = False

        def __init__(self, model_runner, topk: int, speculative_num_steps: int) -> None:
            if topk != 1:
                raise ValueError(
                    "hstrace CPU shim: EAGLE on torch_native needs --speculative-eagle-topk 1"
                )
            self.topk = topk
            self.speculative_num_steps = speculative_num_steps
            self.attn_backends = [
                TorchNativeDraftStepBackend(model_runner, i)
                for i in range(speculative_num_steps - 1)
            ]

        def init_forward_metadata(self, forward_batch) -> None:
            for backend in self.attn_backends:
                backend.init_forward_metadata(forward_batch)

        def init_cuda_graph_state(self, *args, **kwargs) -> None:
            raise RuntimeError("hstrace CPU shim: no CUDA graphs (use --disable-cuda-graph)")

    module.TorchNativeDraftStepBackend = TorchNativeDraftStepBackend
    module.TorchNativeMultiStepDraftBackend = TorchNativeMultiStepDraftBackend


def _patch_draft_utils(module: Any) -> None:
    """`DraftBackendFactory` knows no torch_native draft backends: give it the CPU ones."""
    factory = module.DraftBackendFactory
    create_decode, create_extend = (
        factory.create_decode_backend,
        factory.create_draft_extend_backend,
    )

    def _configured(self, decode: bool) -> str:
        prefill_backend, decode_backend = module.attention_backends()
        return self.draft_attn_backend or (decode_backend if decode else prefill_backend)

    def _stamp(backend: Any) -> Any:
        backend.prefill_attention_backend_str = "torch_native"
        backend.decode_attention_backend_str = "torch_native"
        return backend

    def create_decode_backend(self):
        if self.speculative_num_steps <= 1 or _configured(self, True) != "torch_native":
            return create_decode(self)
        from sglang.srt.layers.attention import torch_native_backend as tn

        backend = tn.TorchNativeMultiStepDraftBackend(
            self.draft_model_runner, self.topk, self.speculative_num_steps
        )
        for child in backend.attn_backends:
            _stamp(child)
        return _stamp(backend)

    def create_draft_extend_backend(self):
        decode = module.get_spec().speculative_attention_mode == "decode"
        if _configured(self, decode) != "torch_native":
            return create_extend(self)
        from sglang.srt.layers.attention import torch_native_backend as tn

        return _stamp(tn.TorchNativeAttnBackend(self.draft_model_runner))

    create_decode_backend.hstrace_cpu_stand_in = True  # type: ignore[attr-defined]
    create_draft_extend_backend.hstrace_cpu_stand_in = True  # type: ignore[attr-defined]
    factory.create_decode_backend = create_decode_backend
    factory.create_draft_extend_backend = create_draft_extend_backend


def _kernel_patcher(names: list[str]) -> Callable[[Any], None]:
    def patch(module: Any) -> None:
        for name in names:
            if not hasattr(module, name):
                raise RuntimeError(f"hstrace CPU shim: {module.__name__}.{name} is missing")
            setattr(module, name, TorchKernel(name, KERNELS[(module.__name__, name)]))

    return patch


def patches() -> dict[str, list[Callable[[Any], None]]]:
    out: dict[str, list[Callable[[Any], None]]] = {
        "sglang.srt.mem_cache.memory_pool": [_patch_memory_pool],
        "sglang.kernels.ops.speculative.spec_tree": [_patch_spec_tree],
        "sglang.srt.layers.attention.torch_native_backend": [_patch_torch_native],
        "sglang.srt.speculative.draft_utils": [_patch_draft_utils],
    }
    by_module: dict[str, list[str]] = {}
    for module, name in KERNELS:
        by_module.setdefault(module, []).append(name)
    for module, names in by_module.items():
        out.setdefault(module, []).append(_kernel_patcher(names))
    return out


def install() -> None:
    """Install every stand-in (a module already imported is patched now)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    if not _torchvision_importable():
        sys.meta_path.insert(0, TorchvisionStandIn())
    patch_modules(patches())
