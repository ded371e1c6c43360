"""Native kernels for the lean decoder's decode step, the sampler's draw, the update's log-prob
head and the re-test drift's KL: built once per machine, optional.

`native_kernels()` loads the library that native_build.py compiles from native_kernels.cpp
with the system C++ compiler the first time a machine needs it, in the configured cache
directory under native/, hashed after the build and before every load. Where there is no
compiler, the build fails, the cache directory is one other users can write, the dtype is
neither bfloat16 nor float32, or `GRPOGATE_NATIVE=0` is set, it returns None and the decoder
runs its torch operations instead (decoding.LeanStepper records which ran: `lean` or
`lean-native`), and so do the update's log-prob head (training.logprobs), the sampler's draw
(sampling.rollout) and the drift's KL (sampling.drift). A build that fails or is refused is
said once on the terminal, and the evidence's `environment.native_kernels` records
{built, reason, identity}. The library holds only our own source; nothing a run directory
names is ever built or loaded here.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache
from pathlib import Path

import torch

from grpogate.files.cache_dir import configured_cache_root
from grpogate.engines.cpu.native_build import build_library

DTYPES = {torch.bfloat16: 1, torch.float32: 0}
MAX_GROUP = 8  # query heads per KV head the attention kernel is built for (native_kernels.cpp)
_VOID, _LONG, _FLOAT, _INT = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int


class NativeKernels:
    """The kernels on contiguous CPU tensors of one dtype (bfloat16 or float32)."""

    def __init__(self, library: ctypes.CDLL, identity: str):
        self.library, self.identity = library, identity  # identity: the build's file name
        library.grpogate_rms_norm.argtypes = [_INT, _VOID, _VOID, _VOID, _LONG, _LONG, _FLOAT]
        library.grpogate_add_rms_norm.argtypes = [_INT, _VOID, _VOID, _VOID, _VOID, _LONG,
                                                  _LONG, _FLOAT]
        library.grpogate_silu_mul.argtypes = [_INT, _VOID, _VOID, _LONG, _LONG]
        library.grpogate_decode_attention.argtypes = [_INT] + [_LONG] * 7 + [_FLOAT] + [_VOID] * 12
        library.grpogate_row_logsumexp.argtypes = [_INT, _VOID, _LONG, _LONG, _FLOAT, _VOID,
                                                   _VOID]
        library.grpogate_logprob_backward.argtypes = [_INT, _VOID, _VOID, _LONG, _LONG, _FLOAT,
                                                      _VOID, _VOID, _VOID, _VOID, _VOID]
        library.grpogate_sample_rows.argtypes = [_INT, _VOID, _LONG, _LONG, _FLOAT, _FLOAT, _LONG,
                                                 _VOID, _VOID, _VOID]
        library.grpogate_row_kl.argtypes = [_INT, _VOID, _VOID, _LONG, _LONG, _FLOAT, _VOID,
                                            _VOID]
        library.grpogate_rms_norm_backward.argtypes = [_INT, _VOID, _VOID, _VOID, _VOID, _LONG,
                                                       _LONG, _FLOAT]
        library.grpogate_swiglu.argtypes = [_INT, _VOID, _VOID, _VOID, _LONG]
        library.grpogate_swiglu_backward.argtypes = [_INT, _VOID, _VOID, _VOID, _VOID, _VOID,
                                                     _LONG]
        for function in ("grpogate_rms_norm", "grpogate_add_rms_norm", "grpogate_silu_mul",
                         "grpogate_row_logsumexp", "grpogate_logprob_backward",
                         "grpogate_sample_rows", "grpogate_row_kl", "grpogate_rms_norm_backward",
                         "grpogate_swiglu", "grpogate_swiglu_backward"):
            getattr(library, function).restype = None
        library.grpogate_decode_attention.restype = _INT

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [N, D] -> RMSNorm(x) [N, D], as layers._rms_norm."""
        out = torch.empty_like(x)
        self.library.grpogate_rms_norm(DTYPES[x.dtype], x.data_ptr(), weight.data_ptr(),
                                       out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """hidden += delta in place (both [N, D]); -> RMSNorm(hidden)."""
        out = torch.empty_like(hidden)
        self.library.grpogate_add_rms_norm(DTYPES[hidden.dtype], hidden.data_ptr(),
                                           delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                           hidden.shape[0], hidden.shape[1], eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [N, 2 I] -> silu(gate) * up [N, I]."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty((rows, inter))
        self.library.grpogate_silu_mul(DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(),
                                       rows, inter)
        return out

    def rms_norm_backward(self, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                          eps: float) -> torch.Tensor:
        """x, grad [N, D] -> d loss / d x of rms_norm(x, weight) [N, D] (the weight frozen)."""
        out = torch.empty_like(x)
        self.library.grpogate_rms_norm_backward(DTYPES[x.dtype], x.data_ptr(), weight.data_ptr(),
                                                grad.data_ptr(), out.data_ptr(), x.shape[0],
                                                x.shape[1], eps)
        return out

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up of one shape -> silu(gate) * up, as silu_mul computes it."""
        out = torch.empty_like(gate)
        self.library.grpogate_swiglu(DTYPES[gate.dtype], gate.data_ptr(), up.data_ptr(),
                                     out.data_ptr(), gate.numel())
        return out

    def swiglu_backward(self, gate: torch.Tensor, up: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (d loss / d gate, d loss / d up) of swiglu(gate, up), given its output's grad."""
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        self.library.grpogate_swiglu_backward(DTYPES[gate.dtype], gate.data_ptr(), up.data_ptr(),
                                              grad.data_ptr(), d_gate.data_ptr(),
                                              d_up.data_ptr(), gate.numel())
        return d_gate, d_up

    def decode_attention(self, qkv, cos, sin, positions, prompt_of_row, slot_of_row,
                         prompt_mask, prompt_keys, prompt_values, own_keys, own_values,
                         column: int, heads: int, scale: float) -> torch.Tensor:
        """One decode step's attention for every row (decoding.LeanStepper's cache layout).

        qkv [N, (H + 2 Hkv) d] (before RoPE); cos/sin [C, d]; positions, prompt_of_row,
        slot_of_row [N] int64; prompt_mask [n, S] additive float32; prompt_keys [n, Hkv, d, S]
        and prompt_values [n, Hkv, S, d]; own_keys [M, Hkv, d, T] and own_values [M, Hkv, T,
        d], M >= N slots, row r's at slot_of_row[r], into which the rows' rotated keys and
        values are written at `column` (columns after it are scored and ignored, never summed;
        the caller zeroes the caches all the same, decoding.py); S and T multiples of 16 ->
        [N, H d]."""
        rows = qkv.shape[0]
        _, kv_heads, capacity, head_dim = own_values.shape
        out = qkv.new_empty((rows, heads * head_dim))
        refused = self.library.grpogate_decode_attention(
            DTYPES[qkv.dtype], rows, heads, kv_heads, head_dim, prompt_keys.shape[-1], capacity,
            column, scale, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
            prompt_of_row.data_ptr(), slot_of_row.data_ptr(), prompt_mask.data_ptr(),
            prompt_keys.data_ptr(), prompt_values.data_ptr(), own_keys.data_ptr(),
            own_values.data_ptr(), out.data_ptr())
        if refused:  # `covers` is asked first; this is the kernel's own guard
            raise ValueError(f"native decode attention not built for {heads} heads over "
                             f"{kv_heads} KV heads of {head_dim}, {prompt_keys.shape[-1]} "
                             f"prompt and {capacity} own columns")
        return out

    def row_logsumexp(self, logits: torch.Tensor, temperature: float,
                      entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [R, V] -> float32 logsumexp(logits / temperature) [R] and, if asked, the
        entropy [R] of softmax(logits / temperature)."""
        rows, vocab = logits.shape
        lse = torch.empty(rows, dtype=torch.float32)
        spread = torch.empty(rows, dtype=torch.float32) if entropy else None
        self.library.grpogate_row_logsumexp(DTYPES[logits.dtype], logits.data_ptr(), rows, vocab,
                                            temperature, lse.data_ptr(),
                                            spread.data_ptr() if entropy else None)
        return lse, spread

    def row_kl(self, own: torch.Tensor, base: torch.Tensor,
               temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """own, base [R, V] of one dtype -> float32 (KL(p || q), entropy of p) [R] per row, p =
        softmax(own / temperature), q = softmax(base / temperature)."""
        rows, vocab = own.shape
        kl = torch.empty(rows, dtype=torch.float32)
        entropy = torch.empty(rows, dtype=torch.float32)
        self.library.grpogate_row_kl(DTYPES[own.dtype], own.data_ptr(), base.data_ptr(), rows,
                                     vocab, temperature, kl.data_ptr(), entropy.data_ptr())
        return kl, entropy

    def logprob_backward(self, logits: torch.Tensor, lse: torch.Tensor, temperature: float,
                         offsets: torch.Tensor, order: torch.Tensor, targets: torch.Tensor,
                         grad: torch.Tensor) -> torch.Tensor:
        """The gradient [R, V] (the logits' dtype) of values[m] = logits[u, targets[m]] / T -
        lse[u] for the tokens m of each row u, listed in order[offsets[u]:offsets[u + 1]]
        (int64), given float32 d loss / d values `grad` [M]."""
        rows, vocab = logits.shape
        out = torch.empty_like(logits)
        self.library.grpogate_logprob_backward(
            DTYPES[logits.dtype], logits.data_ptr(), lse.data_ptr(), rows, vocab, temperature,
            offsets.data_ptr(), order.data_ptr(), targets.data_ptr(), grad.data_ptr(),
            out.data_ptr())
        return out

    def sample_rows(self, logits: torch.Tensor, temperature: float, block: int,
                    uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, V], uniforms [N] float64 -> (tokens [N] int64, their float32 log-probs):
        rollout._sample's two-level inverse CDF over the whole softmax(logits / temperature)."""
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.long)
        logprobs = torch.empty(rows, dtype=torch.float32)
        self.library.grpogate_sample_rows(DTYPES[logits.dtype], logits.data_ptr(), rows, vocab,
                                          temperature, 1.0 / temperature, block,
                                          uniforms.data_ptr(), tokens.data_ptr(),
                                          logprobs.data_ptr())
        return tokens, logprobs

    @staticmethod
    def covers(heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether decode_attention is built for this shape: at most 8 query heads per KV head,
        a head dimension that is a multiple of 16 (the kernel's lanes)."""
        return heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and head_dim % 16 == 0


VERIFIED = "sha256 verified against its record before loading"


@lru_cache(maxsize=4)
def _load(root: Path) -> tuple[NativeKernels | None, dict]:
    """The kernels built under `root` and the evidence's account of them; a library that does
    not build, is refused or does not load is said once on the terminal."""
    fd, path, problem = build_library(root)
    if fd is not None:
        # Loaded through the descriptor that was hashed: the bytes checked are the bytes mapped.
        via = f"/proc/self/fd/{fd}" if Path("/proc/self/fd").is_dir() else str(path)
        try:
            kernels = NativeKernels(ctypes.CDLL(via), path.stem)
            return kernels, {"built": True, "reason": VERIFIED, "identity": path.stem}
        except (OSError, AttributeError) as error:
            problem = f"{path} does not load ({error})"
        finally:
            os.close(fd)
    print(f"grpogate: native kernels not used: {problem}; the torch operations run instead",
          file=sys.stderr)
    return None, {"built": False, "reason": problem, "identity": "none"}


def _skipped(dtype: torch.dtype, device: torch.device) -> str:
    """Why the kernels do not apply to tensors of `dtype` on `device` ("" where they do)."""
    if os.environ.get("GRPOGATE_NATIVE", "1") == "0":
        return "GRPOGATE_NATIVE=0"
    if torch.device(device).type != "cpu":
        return f"device {torch.device(device).type}: the kernels are for the CPU"
    if dtype not in DTYPES:
        return f"{str(dtype).removeprefix('torch.')}: the kernels are for bfloat16 and float32"
    return ""


def native_kernels(dtype: torch.dtype, device: torch.device) -> NativeKernels | None:
    """The kernels for tensors of `dtype` on `device`, or None where they do not apply."""
    if _skipped(dtype, device):
        return None
    return _load(configured_cache_root())[0]


def kernels_identity(dtype: torch.dtype, device: torch.device) -> dict:
    """What the evidence's environment records: {"built", "reason", "identity"}: whether this
    process's lean decode step (where it covers the model) and update log-prob head use a
    native build, why or why not, and the build's name (its key: source, compiler, flags,
    CPU identity) or "none". A replay elsewhere compares it: another build may round
    differently, so bit-identical samples are not promised across two. Which step decoded is
    each step's own `decode_path`."""
    skipped = _skipped(dtype, device)
    if skipped:
        return {"built": False, "reason": skipped, "identity": "none"}
    return dict(_load(configured_cache_root())[1])
