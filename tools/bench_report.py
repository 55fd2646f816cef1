"""Markdown tables for BENCHMARKS.md from fusepass-bench JSON files: per problem, mode and precision the
providers' medians, fusepass's ratios, its TFLOP/s (2·N·K·F per GEMM: one in the forward, three in a
training step, over the measured time), the floor and the fraction of it reached, and, from the
tuner's record of this process, the GPU time of the fused op alone and the implementation it chose
(blank where the problem was tuned by an earlier process and read from the disk cache). Inductor's
max-autotune mode has its own columns where the run measured it.

The floor is a lower bound from rates measured on an H200 (BENCHMARKS.md): the GEMMs at the best
cuBLAS rate of their precision (3xTF32: a third of TF32's), or the forward's unavoidable traffic (read
x and W as the model holds them, write the output once) at the measured copy bandwidth, whichever is
longer; a training step's floor counts its three GEMMs only. Left blank for other GPUs.

Usage: python tools/bench_report.py FILE.json [FILE.json ...]"""

from __future__ import annotations

import sys
import json
from pathlib import Path

from tabulate import tabulate

SIZES = {  # N, K, F of the reference problems
    "gemm_scale_batchnorm": (16384, 4096, 4096),
    "gemm_scale_batchnorm_1024": (1024, 8192, 8192),
    "gemm_batchnorm_scale_softmax": (1024, 8192, 8192),
    "gemm_scale_batchnorm_small": (128, 1024, 512),
    "gemm_batchnorm_scale_softmax_small": (128, 1024, 512),
}
# Measured on an H200 (BENCHMARKS.md): cuBLAS TF32 up to 413 TFLOP/s (3xTF32: ~130 with three products),
# cuBLAS bf16 up to 709 TFLOP/s, device copy 4.2 TB/s.
GEMM_RATE = {"fp32": 130e12, "tf32": 413e12, "bf16-autocast": 709e12}
COPY_BYTES_PER_S = 4.2e12
OUT_BYTES = {"fp32": 4, "tf32": 4, "bf16-autocast": 2}
PRECISION_IN_KEY = {"fp32": "torch.float32 tf32x3 gemm", "tf32": "torch.float32 tf32 gemm",
                    "bf16-autocast": "torch.bfloat16 native gemm"}


def op_timing(tuning: dict, problem: str, mode: str, precision: str) -> tuple[str, str]:
    """(best op ms, chosen implementation) for the tuner's entry of this problem, if any."""
    n, k, f = SIZES[problem]
    wanted = (f"{n}x{k}->{f} {PRECISION_IN_KEY[precision]}", f"train={mode == 'train'}",
              f"softmax={'softmax' in problem}")
    for key, times in tuning.items():
        if all(w in key for w in wanted) and times:
            name = min(times, key=times.get)
            return f"{times[name]:.3f}", name
    return "", ""


def floor_ms(n: int, k: int, f: int, precision: str, backward: bool) -> float:
    gemm_s = 2 * n * k * f * (3 if backward else 1) / GEMM_RATE[precision]
    traffic_s = 0.0 if backward else (4 * (n * k + f * k) + OUT_BYTES[precision] * n * f) / COPY_BYTES_PER_S
    return max(gemm_s, traffic_s) * 1e3


def table(payload: dict) -> str:
    on_h200 = "H200" in payload["environment"]["device"]
    rows = []
    by_case: dict[tuple, dict] = {}
    for r in payload["results"]:
        by_case.setdefault((r["problem"], r["mode"], r["precision"]), {})[r["provider"]] = r
    for (problem, mode, precision), providers in by_case.items():
        fused = providers.get("fusepass")
        if fused is None or fused["median_ms"] is None:
            continue
        n, k, f = SIZES[problem]
        gemms = 3 if payload["config"]["backward"] else 1  # forward; with the backward, two more GEMMs
        tflops = 2 * gemms * n * k * f / fused["median_ms"] / 1e9
        op_ms, chosen = op_timing(payload.get("fusepass_tuning", {}), problem, mode, precision)
        floor = floor_ms(n, k, f, precision, payload["config"]["backward"]) if on_h200 else None
        autotuned = providers.get("max-autotune", {}).get("median_ms")
        rows.append([
            f"{problem} {n}×{k}→{f}", mode, precision,
            *(f"{providers[p]['median_ms']:.3f}" if p in providers else "" for p in ("eager", "inductor")),
            f"{autotuned:.3f}" if autotuned else "",
            f"{fused['median_ms']:.3f}", f"{fused['speedup_vs_eager']:.2f}", f"{fused['speedup_vs_inductor']:.2f}",
            f"{autotuned / fused['median_ms']:.2f}" if autotuned else "",
            f"{tflops:.0f}", f"{floor:.3f}" if floor else "", f"{floor / fused['median_ms']:.0%}" if floor else "",
            op_ms, chosen,
            f"{fused['rel_error']:.2e} / {providers['eager']['rel_error']:.2e}",
            f"{providers['eager']['peak_mb']:.0f} / {fused['peak_mb']:.0f}",
        ])
    headers = ["problem", "mode", "precision", "eager ms", "Inductor ms", "max-autotune ms", "fusepass ms", "vs eager",
               "vs Inductor", "vs max-autotune",
               "TFLOP/s", "floor ms", "of floor", "op alone ms", "implementation chosen", "rel err fusepass / eager", "peak MB eager / fusepass"]
    return tabulate(rows, headers, tablefmt="github")


def main(paths: list[str]) -> None:
    for path in paths:
        payload = json.loads(Path(path).read_text())
        env = payload["environment"]
        print(f"\n`{path}`: {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}\n")
        print(table(payload))


if __name__ == "__main__":
    main(sys.argv[1:])
