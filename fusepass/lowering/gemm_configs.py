"""The GEMM's tile configs (gemm.py): the candidates for each precision, best first, and the short list a
quick search times."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from fusepass.lowering.gemm_precisions import PRE_SPLIT


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False  # load the operand tiles through host-made TMA descriptors (Hopper's bulk copy engine)
    persistent: bool = False  # one program per SM over the tiles, loading through in-kernel TMA descriptors
    warp_specialized: bool = False  # split_w/x, round_w/x on warp_specialized_gemm.py's Gluon kernel
    split_in_kernel: bool = False  # warp-specialized: the prepared operand's tiles split in shared memory, no copy
    split_k: bool = False  # warp-specialized, split in the kernel: K split across programs where tiles are few

    def describe(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} "
                f"w{self.num_warps} s{self.num_stages}" + (" tma" if self.tma else "")
                + (" persistent" if self.persistent else "") + (" split-K" if self.split_k else "")
                + (" warp-specialized" if self.warp_specialized else "")
                + (" split in kernel" if self.split_in_kernel else ""))

    def with_tma(self) -> "GemmConfig":
        return dataclasses.replace(self, tma=True)


def candidates(precision: str, dtype: torch.dtype) -> list[GemmConfig]:
    """Candidate tile shapes, from one place, best first (measured on an H200 with tools/tune_gemm.py;
    the first is the default when tuning is off). Three-pass fp32 keeps a second accumulator and the
    split halves in registers, so it gets 128 x 128 tiles; small 64-row tiles are for small problems.
    The first config is also offered with host-made TMA descriptors, and a persistent one (_persistent;
    each only where gemm.unlaunchable allows: TMA's layout). TF32 with an operand rounded in memory
    (H100, tile configs timed at the seed and MLP shapes): round_x fastest on 256 x 128 tiles, round_w's
    weight gradients on 128 x 256 x 32 in four stages (8192 x 1024 -> 8192: 0.519 ms, cuBLAS 0.559).
    3xTF32 split in registers lost its 64 x 64 x 64 config when MoCo v3's test, judged step by step,
    failed with it: a criterion eager fails against itself there (tests/test_real_models.py), not a
    drift of those tiles (as exact alone as 128 x 128); it has not been measured back in. bf16 and fp16
    take their small tiles in five stages: with few output tiles each program's K loop is long (H100, by
    GPU time against three stages: 1024 x 4096 -> 256 0.016 against 0.027 ms, 4096 x 4096 -> 256 0.029
    against 0.036, 128 x 512 -> 1024 0.0042 against 0.0054)."""
    if precision == "tf32x3":
        configs = [GemmConfig(128, 128, 64, 8, 8, 3)]
    elif precision in PRE_SPLIT:
        configs = [GemmConfig(128, 128, 32, 8, 8, 3), GemmConfig(128, 128, 32, 8, 8, 4)]
    elif precision == "tf32":
        configs = [GemmConfig(128, 256, 32, 8, 8, 3), GemmConfig(128, 128, 32, 8, 4, 4),
                   GemmConfig(64, 64, 64, 8, 4, 3)]
    elif precision == "round_x":
        configs = [GemmConfig(256, 128, 32, 8, 8, 3), GemmConfig(128, 128, 32, 8, 8, 4),
                   GemmConfig(64, 64, 64, 8, 4, 3)]
    elif precision == "round_w":
        configs = [GemmConfig(128, 256, 32, 8, 8, 4), GemmConfig(256, 128, 32, 8, 8, 3),
                   GemmConfig(64, 64, 64, 8, 4, 3)]
    elif precision == "cast_w":
        configs = [GemmConfig(256, 128, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 4),
                   GemmConfig(64, 64, 64, 8, 4, 3)]
    else:
        configs = [GemmConfig(128, 256, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 4),
                   GemmConfig(64, 64, 64, 8, 4, 5)]
    return configs + [_persistent(precision, configs[0]), configs[0].with_tma()]


def _persistent(precision: str, first: GemmConfig) -> GemmConfig:
    """The persistent candidate: on the first's tiles, but round_w's 128 x 256 tiles, which persistent
    need 262 KB of shared memory (an H100 has 227), give way to 256 x 128.
    Measured on an H100: 0.95-0.99x cuBLAS bf16 at the seed chains' and the MLP's wide layers, against
    0.78-0.84x a program per tile (BENCHMARKS.md "GEMM alone"); in 3xTF32 the best of each shape 3-8%
    faster (split_x 1024 x 8192 -> 8192 1.284 against 1.325 ms; a weight gradient 8192 x 1024 -> 8192,
    split_x, 1.413 against 1.528), slower at split_x 16384 x 4096 (split_w wins); tf32 up to 14% (16384 x
    4096 -> 4096: 2.313 against 2.633 ms); round_x's 256 x 128 tiles the fastest TF32 at the four forward
    shapes of 1024 to 16384 rows (1024 x 8192 -> 8192: 0.495 ms, against 0.535 a program per tile)."""
    if precision == "round_w":
        first = GemmConfig(256, 128, 32, 8, 8, 3)
    return dataclasses.replace(first, persistent=True)


def shortlist(configs: list[GemmConfig], m: int, n: int, device: torch.device) -> list[GemmConfig]:
    """The configs a short search times: those with the first's tile shape (its pipeline depths and TMA
    twin), the persistent one, and the smallest tiles where the first's would give fewer programs than the GPU has SMs
    (measured at 128 x 1024 -> 512 on an H100: 16 tiles of 128 x 128 for 132 SMs)."""
    first = configs[0]
    chosen = [c for c in configs if (c.block_m, c.block_n, c.block_k) == (first.block_m, first.block_n, first.block_k)
              or c.persistent]
    if triton.cdiv(m, first.block_m) * triton.cdiv(n, first.block_n) < sm_count(device):
        smallest = min(configs, key=lambda c: c.block_m * c.block_n)
        chosen += [c for c in configs if c.block_m * c.block_n == smallest.block_m * smallest.block_n
                   and c not in chosen]
    return chosen


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
