"""tools/benchmark_report.py: the report written from small synthetic fusepass-bench JSON (CPU only),
and the run step's commands against the real CLI."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "benchmark_report.py"


def load_tool(path: Path = TOOL):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


report = load_tool()

SIZE_1024 = [1024, 8192, 8192]
# Hand-checked: 2 * 1024 * 8192 * 8192 FLOP at 165 TFLOP/s (H200, fp32 as 3xTF32) = 0.8330 ms, more
# than the traffic ((4 * (1024*8192 + 8192*8192) + 4 * 1024*8192) B at 4.2 TB/s = 0.080 ms).
FLOOR_FP32_1024_MS = 0.833
FUSED_MS = 2.114  # the floor is 39% of it


def result(provider, median_ms, *, problem="gemm_scale_batchnorm@1024x8192x8192", mode="train", precision="fp32",
           size=SIZE_1024, correct=True, compile_s=1.0, peak_mb=1000.0, **extra):
    row = {"problem": problem, "mode": mode, "precision": precision, "provider": provider, "correct": correct,
           "median_ms": median_ms if correct else None, "p20_ms": median_ms, "p80_ms": median_ms,
           "compile_s": compile_s, "peak_mb": peak_mb, **extra}
    if size is not None:
        row["size"] = size
    return row


def payload(results, *, device="NVIDIA H200", backward=False, date="2030-01-01T00:00:00+00:00", report=None):
    data = {"environment": {"device": device, "torch": "9.9.0", "triton": "8.8.0", "date": date,
                            "command": "fusepass-bench ..."},
            "config": {"backward": backward, "seeds": 2, "rep_ms": 200, "shrink": 1},
            "results": results}
    if report:
        data["report"] = report
    return data


def four_providers(**kwargs):
    return [result("eager", 4.228, **kwargs), result("inductor", 3.171, **kwargs),
            result("max-autotune", 2.6425, **kwargs), result("fusepass", FUSED_MS, **kwargs)]


def write_report(tmp_path, payloads, kept=None) -> str:
    json_dir = tmp_path / "benchmarks"
    json_dir.mkdir(exist_ok=True)
    for name, data in payloads.items():
        (json_dir / f"{name}.json").write_text(json.dumps(data))
    output = tmp_path / "BENCHMARKS.md"
    if kept is not None:
        output.write_text("# Old report\n\nold tables\n\n" + kept)
    report.write(json_dir, output)
    return output.read_text()


def section_text(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def table_line(text: str, title: str, *cells: str) -> list[str]:
    """The cells of the one row of section `title` whose line holds all of `cells`."""
    lines = [line for line in section_text(text, title).splitlines()
             if line.startswith("|") and all(c in line for c in cells)]
    assert len(lines) == 1, lines
    return [cell.strip() for cell in lines[0].strip("|").split("|")]


def test_forward_table_has_every_provider_ratios_and_floor(tmp_path):
    text = write_report(tmp_path, {"forward-fp32": payload(four_providers())})
    forward = section_text(text, "Forward, fp32")
    for header in ("eager ms", "Inductor ms", "max-autotune ms", "fusepass ms", "floor ms", "of floor"):
        assert header in forward
    cells = table_line(text, "Forward, fp32", "gemm_scale_batchnorm 1024×8192→8192", "train")
    assert cells[2:6] == ["4.228", "3.171", "2.643", "2.114"]
    assert cells[6:9] == ["2.00×", "1.50×", "1.25×"]  # eager's, Inductor's, max-autotune's time over fusepass's
    assert cells[9:] == [f"{FLOOR_FP32_1024_MS:.3f}", "39%", "H200"]


def test_forward_rows_from_two_gpus_say_which(tmp_path):
    """A table's rows may come from runs on different GPUs; each row names its own."""
    text = write_report(tmp_path, {"forward-fp32": payload(four_providers()),
                                   "forward-fp32-1024": payload(four_providers(problem="gemm_batchnorm", size=None),
                                                                device="NVIDIA H100 80GB HBM3")})
    assert table_line(text, "Forward, fp32", "gemm_scale_batchnorm 1024×8192→8192", "train")[-1] == "H200"
    assert table_line(text, "Forward, fp32", "gemm_batchnorm", "train")[-1] == "H100"


def test_a_row_whose_providers_ran_on_two_gpus_names_both(tmp_path):
    """A later run of the default-mode providers on another GPU leaves the CUDA-graph providers' older rows
    beside them: the row says which GPU measured which."""
    old = [result(p, ms) for p, ms in (("eager", 9.0), ("inductor", 8.0), ("fusepass", 4.0),
                                       ("inductor-cudagraphs", 7.0), ("fusepass-cudagraphs", 3.5))]
    new = [result(p, ms) for p, ms in (("eager", 9.5), ("inductor", 8.5), ("fusepass", 4.5))]
    text = write_report(tmp_path, {"old": payload(old, backward=True, date="2029-01-01T00:00:00+00:00"),
                                   "new": payload(new, backward=True, device="NVIDIA H100 80GB HBM3")})
    cells = table_line(text, "Training step", "gemm_scale_batchnorm 1024×8192→8192", "fp32")
    assert cells[2:5] == ["9.500", "8.500", "4.500"] and cells[8:10] == ["7.000", "3.500"]
    assert cells[-1] == "H100 (eager inductor fusepass), H200 (inductor-cudagraphs fusepass-cudagraphs)"


def test_training_step_floor_counts_three_gemms(tmp_path):
    rows = [result("eager", 8.458), result("inductor", 6.344), result("fusepass", 4.229)]
    text = write_report(tmp_path, {"training": payload(rows, backward=True)})
    cells = table_line(text, "Training step", "gemm_scale_batchnorm 1024×8192→8192", "fp32")
    assert cells[2:8] == ["8.458", "6.344", "4.229", "2.00×", "1.50×", "-"]  # "-": a file without rounds
    assert cells[8:13] == ["-"] * 5  # no CUDA-graph providers measured
    assert cells[13:] == ["2.499", "59%", "H200"]  # 3 * 0.8330 ms over 4.229 ms
    assert "Not measured" in section_text(text, "Forward, fp32")  # a training step is not a forward


def test_training_step_with_cuda_graphs_and_a_counted_flop_floor(tmp_path):
    """A model whose GEMMs are not one N x K x F (the MLP) takes its floor from the bench's FLOP count."""
    flop = 2 * 4096 * (1024 * 4096 + 4096 * 4096 + 4096 * 256)
    rows = [result(p, ms, problem="mlp_batchnorm", size=[4096, 1024, 256], forward_flop=flop)
            for p, ms in (("eager", 12.0), ("inductor", 10.0), ("fusepass", 6.0), ("inductor-cudagraphs", 9.0),
                          ("fusepass-cudagraphs", 4.5))]
    text = write_report(tmp_path, {"training": payload(rows, backward=True)})
    cells = table_line(text, "Training step", "mlp_batchnorm 4096×1024→256", "fp32")
    assert cells[2:13] == ["12.000", "10.000", "6.000", "2.00×", "1.67×", "-", "9.000", "4.500", "2.67×", "2.00×",
                           "-"]
    assert cells[13] == f"{3 * flop / 165e12 * 1e3:.3f}"


def test_training_step_shows_the_range_of_its_rounds_ratios(tmp_path):
    rounds = {"inductor": [6.0, 6.6, 6.3], "fusepass": [5.0, 6.0, 4.5], "inductor-cudagraphs": [3.0, 3.0, 3.0],
              "fusepass-cudagraphs": [2.0, 2.5, 3.0]}
    rows = [result("eager", 8.0)] + [result(p, 5.0, round_medians_ms=ms) for p, ms in rounds.items()]
    text = write_report(tmp_path, {"training": payload(rows, backward=True)})
    cells = table_line(text, "Training step", "gemm_scale_batchnorm 1024×8192→8192", "fp32")
    assert cells[7] == "1.10–1.40×"  # 6.6 / 6.0 and 6.3 / 4.5, round by round
    assert cells[12] == "1.00–1.50×"  # 3.0 / 3.0 and 3.0 / 2.0


def test_missing_provider_is_a_dash_and_a_wrong_one_says_so(tmp_path):
    rows = [result("eager", 4.228), result("inductor", 3.171, correct=False), result("fusepass", FUSED_MS)]
    text = write_report(tmp_path, {"forward-fp32": payload(rows)})
    cells = table_line(text, "Forward, fp32", "gemm_scale_batchnorm 1024×8192→8192", "train")
    assert cells[2:6] == ["4.228", "wrong", "-", "2.114"]
    assert cells[6:9] == ["2.00×", "-", "-"]


@pytest.mark.parametrize("field", ["fusepass_fallbacks", "fallbacks"])
def test_a_fusepass_provider_with_fallbacks_is_wrong(tmp_path, field):
    rows = [result("eager", 4.228), result("fusepass", FUSED_MS, **{field: 1})]
    text = write_report(tmp_path, {"forward-fp32": payload(rows)})
    cells = table_line(text, "Forward, fp32", "gemm_scale_batchnorm 1024×8192→8192", "train")
    assert cells[5] == "wrong" and cells[-2] == "-"  # no fusepass time, no share of the floor


def test_tried_and_rejected_section_is_kept_verbatim(tmp_path):
    kept = "## Tried and rejected\n\n- **Something**: 2.7× slower (`abc1234`).\n  second line, kept as is  \n"
    text = write_report(tmp_path, {"forward-fp32": payload(four_providers())}, kept=kept)
    assert text.endswith(kept)
    assert "old tables" not in text
    again = write_report(tmp_path, {}, kept=None)  # the report now on disk is the one just written
    assert again.endswith(kept)


def test_header_states_gpu_versions_date_and_the_command(tmp_path):
    text = write_report(tmp_path, {"forward-fp32": payload(four_providers())})
    head = text.split("## Forward, fp32")[0]
    assert "NVIDIA H200, torch 9.9.0, triton 8.8.0" in head and "2030-01-01T00:00:00+00:00" in head
    assert "python tools/benchmark_report.py" in head and "python tools/benchmark_report.py write" in head


def test_newer_rows_win(tmp_path):
    old = [result("eager", 9.0), result("fusepass", 9.0)]
    text = write_report(tmp_path, {"old": payload(old, date="2029-01-01T00:00:00+00:00"),
                                   "new": payload(four_providers())})
    cells = table_line(text, "Forward, fp32", "gemm_scale_batchnorm 1024×8192→8192", "train")
    assert cells[2] == "4.228"  # the newer file's row, one row for both names
    sources = section_text(text, "Sources")
    assert "new.json" in sources and "old.json" not in sources  # nothing of it is shown


def test_a_ratio_is_of_two_rows_of_one_run(tmp_path):
    """A later run of some providers leaves max-autotune's older row shown, but no ratio against it."""
    old = four_providers()
    new = [result("eager", 4.0), result("inductor", 3.0), result("fusepass", 2.0)]
    text = write_report(tmp_path, {"old": payload(old, date="2029-01-01T00:00:00+00:00"), "new": payload(new)})
    cells = table_line(text, "Forward, fp32", "gemm_scale_batchnorm 1024×8192→8192", "train")
    assert cells[2:6] == ["4.000", "3.000", "2.643", "2.000"]
    assert cells[6:9] == ["2.00×", "1.50×", "-"]


def test_small_shapes_and_unknown_gpu(tmp_path):
    small = [result(p, ms, problem="gemm_scale_batchnorm@128x1024x512", size=[128, 1024, 512])
             for p, ms in (("eager", 0.05), ("fusepass", 0.1))]
    text = write_report(tmp_path, {"small": payload(small, device="NVIDIA H100 80GB HBM3")})
    cells = table_line(text, "Small shapes, 128×1024→512", "gemm_scale_batchnorm", "train")
    assert cells[1:3] == ["forward", "train"] and cells[4:8] == ["0.050", "-", "-", "0.100"]
    assert cells[-3:] == ["-", "-", "H100"]  # no measured rates for an H100: no floor
    assert "Not measured" in section_text(text, "Forward, fp32")


def test_compile_and_memory_tables(tmp_path):
    warm = payload(four_providers(), report={"section": "compile-warm", "caches": "warm", "caches_note": "second"})
    rows = four_providers(own_peak_mb=500.0)
    rows[3]["own_peak_mb"] = 400.0
    text = write_report(tmp_path, {"forward": payload(rows, report={"caches": "cold", "caches_note": "first"}),
                                   "warm": warm})
    assert "- **cold**: first" in text and "- **warm**: second" in text
    compile_rows = [line for line in section_text(text, "Compile time").splitlines() if "1024×8192→8192" in line]
    assert len(compile_rows) == 2  # cold, from the forward run; warm, from the compile-only run
    memory = table_line(text, "Peak memory", "forward", "gemm_scale_batchnorm 1024×8192→8192")
    assert memory[-3:] == ["0.80×", "0.80×", "H200"]
    # the compile-only run recorded no own peak: its rows are not in the table
    assert len([line for line in section_text(text, "Peak memory").splitlines() if "1024×8192→8192" in line]) == 1
    assert "compile-warm" not in section_text(text, "Forward, fp32")


def test_help_runs_from_the_repository_root():
    done = subprocess.run([sys.executable, "tools/benchmark_report.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "forward-fp32" in done.stdout and "write" in done.stdout


def test_run_commands_match_the_bench_cli(monkeypatch):
    bench = pytest.importorskip("fusepass.bench")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU-only modes' commands parse too
    bucket_tool, gemm_tool = load_tool(report.BUCKET_TOOL), load_tool(report.GEMM_TOOL)
    for spec in report.SPECS:
        argv = spec.argv(Path("out.json"))
        if spec.gemm_alone:
            assert argv[1] == report.GEMM_TOOL and gemm_tool.parser().parse_args(argv[2:]).json == "out.json"
            continue
        if spec.bucket_sizes:
            assert argv[1] == report.BUCKET_TOOL
            args = bucket_tool.parser().parse_args(argv[2:])
            assert (ROOT / args.problem).is_file() and args.json == "out.json" and args.sizes == spec.bucket_sizes
            continue
        assert argv[1:3] == ["-m", "fusepass.bench"]
        problems, cfg, _ = bench.parse_args(argv[3:])
        assert all((ROOT / p).is_file() for p in problems)
        assert cfg.providers[0] == "eager" and {"eager", "inductor", "fusepass"} <= set(cfg.providers)
    called = {name for call in report.DEVICE_CALLS for name in call}
    assert all(s.section in called or s.name in called for s in report.SPECS)
    assert called <= set(report.SECTIONS) | {s.name for s in report.SPECS}


def test_shape_changes_section_has_every_step_and_the_totals(tmp_path):
    steps = {"inductor": [4.5, 0.0, 2.66], "fusepass": [5.5, 0.01, 0.3]}
    run = {"problem": "gemm_scale_batchnorm", "mode": "train", "precision": "fp32", "sequence": [1024, 1024, 777],
           "results": [{"provider": name, "caches": "cold", "steps": times, "steady": {},
                        "compile_and_tune": times[0] + times[2]} for name, times in steps.items()]}
    shapes = {"environment": {"device": "NVIDIA H100", "torch": "9.9.0", "triton": "8.8.0",
                              "date": "2030-01-01T00:00:00+00:00",
                              "command": "fusepass-bench p.py --size 1024,4096,4096 --batch-sequence 1024,1024,777"},
              "shape_changes": [run]}
    text = write_report(tmp_path, {"forward-fp32": payload(four_providers()), "shape-changes-train-fp32": shapes})
    shown = section_text(text, "Shape changes")
    assert "gemm_scale_batchnorm at 1024,4096,4096, train, fp32" in shown
    assert table_line(text, "Shape changes", "777")[2:4] == ["2.66", "0.30"]
    assert table_line(text, "Shape changes", "| total")[2:4] == ["7.16", "5.81"]
    assert "shape-changes-train-fp32" not in section_text(text, "Sources")  # not a timing source


def test_bucket_vs_exact_table_follows_the_shape_changes_with_both_ratios(tmp_path):
    row = {"rows": 1024, "static_exact_ms": 1.2, "symbolic_exact_ms": 1.5, "bucketed_ms": 1.44,
           "inductor_static_ms": 2.0, "inductor_symbolic_ms": 2.1}
    run = {"problem": "gemm_scale_batchnorm", "size": [1024, 4096, 4096], "mode": "train", "precision": "fp32",
           "backward": True, "traced_at": 777, "rows": [row]}
    steady = {"environment": {"device": "NVIDIA H200", "torch": "9.9.0", "triton": "8.8.0",
                              "date": "2030-01-01T00:00:00+00:00", "command": "python tools/bucket_vs_exact.py"},
              "bucket_vs_exact": [run]}
    text = write_report(tmp_path, {"forward-fp32": payload(four_providers()), "bucket-vs-exact-train-fp32": steady})
    assert "gemm_scale_batchnorm at 1024,4096,4096, train, fp32, symbolic graph traced at 777 rows" in text
    assert table_line(text, "Shape changes", "| 1024") == ["1024", "1.200", "1.500", "1.440", "0.960", "1.200",
                                                           "2.000", "2.100"]
    assert "bucket-vs-exact-train-fp32" not in section_text(text, "Sources")  # not a timing source


def test_gemm_alone_section_has_both_kernels_the_ratio_and_the_peak_fraction(tmp_path):
    row = {"m": 1024, "k": 8192, "n": 8192, "precision": "bf16", "cublas_ms": 0.2, "cublas_tflops": 687.2,
           "cublas_rel_err": 2e-3, "fusepass_config": "native 128x256x64 g8 w8 s3", "fusepass_ms": 0.25,
           "fusepass_tflops": 549.8, "fusepass_rel_err": 2.1e-3, "vs_cublas": 0.8, "of_peak": 0.556}
    gemms = {"environment": {"device": "NVIDIA H100", "torch": "9.9.0", "triton": "8.8.0",
                             "date": "2030-01-01T00:00:00+00:00", "command": "python tools/gemm_alone.py"},
             "gemm_alone": [row]}
    text = write_report(tmp_path, {"forward-fp32": payload(four_providers()), "gemm-alone": gemms})
    assert "NVIDIA H100, torch 9.9.0, triton 8.8.0, 2030-01-01" in section_text(text, "GEMM alone")
    assert table_line(text, "GEMM alone", "1024×8192→8192") == [
        "1024×8192→8192", "bf16", "0.200", "687", "0.250", "550", "native 128x256x64 g8 w8 s3", "0.80×", "56%",
        "2.0e-03", "2.1e-03"]
    assert "gemm-alone" not in section_text(text, "Sources")  # not a timing source
    assert "By GPU time" not in section_text(text, "GEMM alone")  # a file without GPU times has one table


def test_gemm_alone_section_has_a_table_by_gpu_time_where_the_file_records_it(tmp_path):
    launched = {"m": 4096, "k": 4096, "n": 256, "precision": "tf32x3", "cublas_ms": 0.19, "cublas_tflops": 45.2,
                "cublas_rel_err": 6e-7, "fusepass_config": "split_w 128x128x32", "fusepass_ms": 0.16,
                "fusepass_tflops": 53.7, "fusepass_rel_err": 2.4e-7, "vs_cublas": 1.19, "of_peak": 0.325}
    gpu = {"cublas_gpu_ms": 0.18, "cublas_gpu_tflops": 47.7, "fusepass_gpu_config": "split_w 128x128x32 split-K",
           "fusepass_gpu_ms": 0.08, "fusepass_gpu_tflops": 107.4, "fusepass_gpu_rel_err": 2.5e-7,
           "gpu_vs_cublas": 2.25, "gpu_of_peak": 0.651}
    gemms = {"environment": {"device": "NVIDIA H200", "torch": "9.9.0", "triton": "8.8.0",
                             "date": "2030-01-01T00:00:00+00:00", "command": "python tools/gemm_alone.py"},
             "gemm_alone": [launched | gpu]}
    text = write_report(tmp_path, {"forward-fp32": payload(four_providers()), "gemm-alone": gemms})
    section = section_text(text, "GEMM alone")
    launched_table, gpu_table = section.split("By GPU time")

    def cells(table: str) -> list[str]:
        (row,) = [line for line in table.splitlines() if line.startswith("| 4096")]
        return [cell.strip() for cell in row.strip("|").split("|")]
    assert cells(launched_table) == ["4096×4096→256", "tf32x3", "0.190", "45", "0.160", "54", "split_w 128x128x32",
                                     "1.19×", "32%", "6.0e-07", "2.4e-07"]
    assert cells(gpu_table) == ["4096×4096→256", "tf32x3", "0.180", "48", "0.080", "107",
                                "split_w 128x128x32 split-K", "2.25×", "65%", "6.0e-07", "2.5e-07"]


def test_largest_batch_section_has_each_provider_and_the_ratio(tmp_path):
    found = {"eager": 700000, "inductor": 640000, "fusepass": 768000}
    run = {"problem": "mlp_batchnorm", "precision": "fp32",
           "results": [{"provider": name, "precision": "fp32", "largest_batch": batch, "limit_reached": False,
                        "tried": {}} for name, batch in found.items()]}
    largest = {"environment": {"device": "NVIDIA H100", "torch": "9.9.0", "triton": "8.8.0",
                               "date": "2030-01-01T00:00:00+00:00", "command": "fusepass-bench p.py --largest-batch"},
               "largest_batch": [run]}
    text = write_report(tmp_path, {"forward-fp32": payload(four_providers()), "largest-batch-mlp": largest})
    assert table_line(text, "Largest batch that trains", "mlp_batchnorm")[:7] == [
        "mlp_batchnorm", "default", "fp32", "700000", "640000", "768000", "1.20×"]
    assert "largest-batch-mlp" not in section_text(text, "Sources")  # not a timing source


def test_a_wide_spread_is_shown_beside_the_median(tmp_path):
    rows = [result("eager", 4.228, p20_ms=1.0, p80_ms=6.0), result("fusepass", FUSED_MS)]
    text = write_report(tmp_path, {"forward-fp32": payload(rows)})
    cells = table_line(text, "Forward, fp32", "gemm_scale_batchnorm 1024×8192→8192", "train")
    assert cells[2] == "4.228 (1.000–6.000)" and cells[5] == "2.114"


def test_the_multi_gpu_table_shows_the_rounds_range_where_a_run_has_rounds():
    def case(problem, round_ms=None):
        ms = {"eager": 4.0, "inductor": 3.0, "fusepass": 2.5}
        result = {"problem": problem, "size": [512, 64, 32], "norm": "batch_norm", "precision": "fp32", "ms": ms,
                  "fused": {"rewrites": 1}}
        return result if round_ms is None else {**result, "round_ms": round_ms}
    rounds = {"eager": [4.0, 4.1], "inductor": [3.0, 3.3], "fusepass": [2.5, 3.0]}
    table = report.multi_gpu_table([(Path("a.json"), {"results": [case("a_problem", rounds), case("b_problem")]})])
    a_row, b_row = [line for line in table.splitlines() if "_problem" in line]
    assert "| 1.10–1.20×" in a_row  # 3.3 / 3.0 and 3.0 / 2.5
    assert "| 1.20×" in a_row and "| -  " in b_row


def test_the_reports_texts_quote_the_thresholds_current_values(tmp_path):
    """The report names fusepass's thresholds with their values; a changed constant must change the text too."""
    from fusepass.lowering import choice, warp_specialized_gemm
    text = report.render([], "", [])
    for module, name in ((choice, "TF32X3_MIN_FLOP"), (choice, "UNGRAPHED_MIN_FLOP"),
                         (warp_specialized_gemm, "UNHIDDEN_MIN_FLOP")):
        value = re.sub(r"e\+0*", "e", f"{getattr(module, name):.2g}")  # 4e+09 as the text writes it: 4e9
        where = module.__name__.rsplit(".", 1)[1]
        quoted = re.findall(rf"`{where}\.{name}`,? \(?([0-9.]+e[0-9]+)", text)
        assert quoted and set(quoted) == {value}, (name, quoted, value)
