"""Markdown tables for BENCHMARKS.md from fusepass-bench JSON files: per problem, mode and precision the
providers' medians, fusepass's ratios, its TFLOP/s (2·N·K·F per GEMM: one in the forward, three in a
training step, over the measured time) and, from the
tuner's record, the GPU time of the fused op alone and the implementation it chose.

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


def table(payload: dict) -> str:
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
        rows.append([
            f"{problem} {n}×{k}→{f}", mode, precision,
            *(f"{providers[p]['median_ms']:.3f}" if p in providers else "" for p in ("eager", "inductor")),
            f"{fused['median_ms']:.3f}", f"{fused['speedup_vs_eager']:.2f}", f"{fused['speedup_vs_inductor']:.2f}",
            f"{tflops:.0f}", op_ms, chosen,
            f"{fused['rel_error']:.2e} / {providers['eager']['rel_error']:.2e}",
            f"{providers['eager']['peak_mb']:.0f} / {fused['peak_mb']:.0f}",
        ])
    headers = ["problem", "mode", "precision", "eager ms", "Inductor ms", "fusepass ms", "vs eager", "vs Inductor",
               "TFLOP/s", "op alone ms", "implementation chosen", "rel err fusepass / eager", "peak MB eager / fusepass"]
    return tabulate(rows, headers, tablefmt="github")


def main(paths: list[str]) -> None:
    for path in paths:
        payload = json.loads(Path(path).read_text())
        env = payload["environment"]
        print(f"\n`{path}`: {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}\n")
        print(table(payload))


if __name__ == "__main__":
    main(sys.argv[1:])
