"""The implementation chooser: fastest candidate, remembered in memory and on disk, skipped when told."""

import dataclasses
import json
import multiprocessing
import threading

import pytest
import torch
from torch._dynamo.utils import counters

from fusepass.lowering import choice, op, tuning
from fusepass.lowering.schema import KernelOptions
from tests.chains import requires_cuda
from tests.lowering.cases import make_args

CPU = torch.device("cpu")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    return tmp_path


def fake_timing(monkeypatch, times):
    calls = []

    def time_candidates(candidates, clock, parallel_on):
        calls.append(list(candidates))
        return {name: times[name] for name in candidates if name in times}

    monkeypatch.setattr(tuning, "_time_candidates", time_candidates)
    return calls


CANDIDATES = {"a": lambda: None, "b": lambda: None, "c": lambda: None}


def problem(name: str, *sizes: int) -> tuning.Problem:
    return tuning.Problem(name, sizes or (1024,))


def test_buckets_are_powers_of_two():
    assert [tuning.bucket(n) for n in (0, 1, 2, 3, 777, 1024, 1025)] == [0, 1, 2, 4, 1024, 1024, 2048]


def test_a_clock_given_times_each_candidate_after_one_untimed_run(cache_dir):
    runs = []
    candidates = {name: (lambda name=name: runs.append(name)) for name in "abc"}
    clock_ms = {"a": 2.0, "b": 0.5, "c": 1.0}

    def clock(run):
        run()
        return clock_ms[runs[-1]]
    assert tuning.Tuner().choose(problem("with a clock"), CPU, candidates, clock=clock) == "b"
    assert runs == ["a", "a", "b", "b", "c", "c"]


def test_parallel_first_runs_are_concurrent_and_precede_the_timing(cache_dir):
    """Every candidate's first run (its compile) happens on a thread of its own before any is timed: the
    three runs below meet at a barrier, which serial runs would never pass."""
    barrier = threading.Barrier(3, timeout=30)
    runs = []

    def candidate(name):
        def run():
            if name not in runs:
                barrier.wait()
            runs.append(name)
        return run

    def clock(run):
        run()
        return {"a": 2.0, "b": 0.5, "c": 1.0}[runs[-1]]
    chosen = tuning.Tuner().choose(problem("in parallel"), CPU, {n: candidate(n) for n in "abc"}, clock=clock,
                                   parallel_first_runs=True)
    assert chosen == "b"
    assert sorted(runs[:3]) == ["a", "b", "c"] and runs[3:] == ["a", "b", "c"]


def test_a_candidate_failing_its_parallel_first_run_is_not_timed(cache_dir):
    timed = []

    def broken():
        raise RuntimeError("out of shared memory")

    def clock(run):
        timed.append(run)
        return 1.0
    candidates = {"broken": broken, "fine": lambda: None}
    chosen = tuning.Tuner().choose(problem("one broken"), CPU, candidates, clock=clock, parallel_first_runs=True)
    assert chosen == "fine"
    assert timed == [candidates["fine"]]


def test_fastest_candidate_is_chosen_and_written_to_disk(cache_dir, monkeypatch):
    calls = fake_timing(monkeypatch, {"a": 3.0, "b": 1.0, "c": 2.0})
    assert tuning.Tuner().choose(problem("problem 1", 1024, 64), CPU, CANDIDATES) == "b"
    assert len(calls) == 1 and counters["fusepass"]["tunings"] == 1
    entries = json.loads((cache_dir / "tuning.json").read_text())
    assert [value for key, value in entries.items() if key.endswith("|problem 1")] == [{"1024x64": "b"}]


def test_a_second_process_reads_the_choice_without_timing(cache_dir, monkeypatch):
    fake_timing(monkeypatch, {"a": 3.0, "b": 1.0, "c": 2.0})
    tuning.Tuner().choose(problem("problem 2"), CPU, CANDIDATES)
    calls = fake_timing(monkeypatch, {"a": 0.1})  # would choose "a" if it timed again
    assert tuning.Tuner().choose(problem("problem 2"), CPU, CANDIDATES) == "b"
    assert calls == []


def test_a_new_bucket_borrows_the_nearest_known_one_without_timing(cache_dir, monkeypatch):
    fake_timing(monkeypatch, {"a": 3.0, "b": 1.0, "c": 2.0})
    tuner = tuning.Tuner()
    tuner.choose(problem("family", 1024, 64), CPU, CANDIDATES)  # timed: b
    fake_timing(monkeypatch, {"a": 1.0, "b": 3.0, "c": 2.0})
    tuner.choose(problem("family", 64, 64), CPU, CANDIDATES)
    assert counters["fusepass"]["borrowed"] == 1  # 64 rows took 1024's b, though a is faster there
    calls = fake_timing(monkeypatch, {"c": 0.1})
    assert tuner.choose(problem("family", 64, 64), CPU, CANDIDATES) == "b"
    assert tuner.choose(problem("family", 2048, 64), CPU, CANDIDATES) == "b"
    assert calls == [] and counters["fusepass"]["tunings"] == 1
    entries = json.loads((cache_dir / "tuning.json").read_text())
    assert list(entries.values()) == [{"1024x64": "b"}]  # borrowed choices stay in the process
    assert tuner.choose(problem("another family", 64, 64), CPU, CANDIDATES) == "c"  # nothing to borrow


def test_nearest_bucket_is_by_the_sizes_log_ratios(cache_dir, monkeypatch):
    tuner = tuning.Tuner()
    for sizes, fastest in (((16, 64), "a"), ((4096, 64), "c")):
        fake_timing(monkeypatch, {name: 0.5 if name == fastest else 2.0 for name in "abc"})
        with tuning.tune_every_bucket():
            tuner.choose(problem("family", *sizes), CPU, CANDIDATES)
    calls = fake_timing(monkeypatch, {})
    assert tuner.choose(problem("family", 1024, 64), CPU, CANDIDATES) == "c"  # 2 doublings from 4096
    assert tuner.choose(problem("family", 32, 64), CPU, CANDIDATES) == "a"
    assert calls == []
    # a neighbour whose choice is not a candidate here is passed over
    assert tuner.choose(problem("family", 2048, 64), CPU, {"a": lambda: None, "b": lambda: None}) == "a"


def test_tune_every_bucket_times_new_buckets(cache_dir, monkeypatch):
    fake_timing(monkeypatch, {"a": 3.0, "b": 1.0, "c": 2.0})
    tuner = tuning.Tuner()
    tuner.choose(problem("family", 1024, 64), CPU, CANDIDATES)
    calls = fake_timing(monkeypatch, {"a": 1.0, "b": 3.0, "c": 2.0})
    with tuning.tune_every_bucket():
        assert tuner.choose(problem("family", 64, 64), CPU, CANDIDATES) == "a"
    assert len(calls) == 1 and counters["fusepass"]["borrowed"] == 0
    assert json.loads((cache_dir / "tuning.json").read_text()).popitem()[1] == {"1024x64": "b", "64x64": "a"}


def test_entries_of_several_problems_are_merged(cache_dir, monkeypatch):
    fake_timing(monkeypatch, {"a": 1.0, "b": 2.0, "c": 3.0})
    tuning.Tuner().choose(problem("problem 3"), CPU, CANDIDATES)
    fake_timing(monkeypatch, {"a": 3.0, "b": 2.0, "c": 1.0})
    tuning.Tuner().choose(problem("problem 4"), CPU, CANDIDATES)
    assert sorted(v["1024"] for v in json.loads((cache_dir / "tuning.json").read_text()).values()) == ["a", "c"]


def _write_choices(writer: int, count: int, start) -> None:
    start.wait()  # every writer's loop at once, whatever each process's start-up took
    for i in range(count):
        tuning._write_cache(f"family {writer}", str(i), "a")


def test_processes_writing_at_once_lose_no_choice(cache_dir):
    """Ranks of one job tune at the same time and each merges its choices into the one file: none may
    be lost to another's write (the second process of the job would time it again)."""
    writers, count = 2, 200
    context = multiprocessing.get_context("spawn")  # the environment (the cache directory) is inherited
    start = context.Barrier(writers)
    processes = [context.Process(target=_write_choices, args=(w, count, start)) for w in range(writers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [process.exitcode for process in processes] == [0] * writers
    entries = json.loads((cache_dir / "tuning.json").read_text())
    assert {family: len(sizes) for family, sizes in entries.items()} == {f"family {w}": count for w in range(writers)}


def test_failed_candidates_are_skipped_and_a_stale_choice_is_retimed(cache_dir, monkeypatch):
    fake_timing(monkeypatch, {"c": 5.0})  # a and b failed
    assert tuning.Tuner().choose(problem("problem 5"), CPU, CANDIDATES) == "c"
    calls = fake_timing(monkeypatch, {"a": 1.0})
    assert tuning.Tuner().choose(problem("problem 5"), CPU, {"a": lambda: None}) == "a"  # "c" no longer offered
    assert len(calls) == 1


def test_tuning_off_takes_the_first_candidate(cache_dir, monkeypatch):
    monkeypatch.setenv(tuning.TUNE_ENV, "0")
    calls = fake_timing(monkeypatch, {"a": 3.0, "b": 1.0})
    assert tuning.Tuner().choose(problem("problem 6"), CPU, CANDIDATES) == "a"
    assert calls == [] and not (cache_dir / "tuning.json").exists()


def test_unwritable_cache_only_logs(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(blocker))
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    fake_timing(monkeypatch, {"a": 2.0, "b": 1.0})
    assert tuning.Tuner().choose(problem("problem 7"), CPU, CANDIDATES) == "b"


@requires_cuda
@pytest.mark.cuda
def test_real_tuning_of_the_op_on_gpu(cache_dir):
    """The op times its implementations once, then a fresh tuner reads the choice from disk."""
    args = make_args(256, 128, 96, device="cuda")
    key = choice.problem(args, traced=False)
    candidates = {name: (lambda run=run: run(args)) for name, run in choice.candidates(args, key).items()}
    chosen = tuning.Tuner().choose(key, torch.device("cuda"), candidates)
    assert chosen in candidates
    assert list(json.loads((cache_dir / "tuning.json").read_text()).values()) == [{"256": chosen}]
    assert tuning.Tuner().choose(key, torch.device("cuda"), {"cublas": candidates["cublas"], chosen: None}) == chosen


@requires_cuda
@pytest.mark.cuda
def test_tuning_leaves_no_memory_behind(cache_dir):
    """Tuning runs cuBLAS on threads and in graph captures, each with a workspace of its own: none of them
    stays allocated once the choice is made."""
    args = make_args(256, 128, 96, device="cuda")
    key = choice.problem(args, traced=False)
    candidates = {name: (lambda run=run: run(args)) for name, run in choice.candidates(args, key).items()}
    candidates["cublas"]()  # this thread's and stream's own workspace, which a model's step makes too
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    tuning.Tuner().choose(key, torch.device("cuda"), candidates, parallel_first_runs=True)
    assert torch.cuda.memory_allocated() <= before


def test_a_flush_timed_under_load_is_timed_again(monkeypatch):
    """The flush's time is subtracted from each candidate's. Taken once while the GPU was busier (other
    processes' work), it made a 512 x 512 matmul measure 0 ms; it is taken again, and the least kept."""
    import triton.testing

    cache = torch.empty(16)
    flush_times = iter([0.30, 0.10, 0.20])  # busy, then quiet, then busy again

    def do_bench_cudagraph(fn, rep, return_mode):
        return next(flush_times) if fn == cache.zero_ else 0.25  # flush + run

    active = type("Driver", (), {"get_empty_cache_for_benchmark": staticmethod(lambda: cache)})
    monkeypatch.setattr(triton.runtime, "driver", type("Drivers", (), {"active": active}))
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", do_bench_cudagraph)
    monkeypatch.setattr(tuning, "_FLUSH_MS", {})
    assert tuning.gpu_time(lambda: None) == pytest.approx(0.15)  # 0.25 - 0.30 < 0: the flush again, 0.10
    assert tuning.gpu_time(lambda: None) == pytest.approx(0.15)  # the least flush time is kept
    assert next(flush_times) == 0.20  # and not taken a third time


def test_a_run_the_flush_hides_even_timed_again_is_timed_alone(monkeypatch):
    """Under a load that makes flush + run measure below the flush twice (seen under 12 test workers on one
    GPU), the run is timed alone, unflushed, rather than reported as taking no time at all."""
    import triton.testing

    cache = torch.empty(16)

    def run():
        return None

    def do_bench_cudagraph(fn, rep, return_mode):
        return {cache.zero_: 0.30, run: 0.04}.get(fn, 0.25)  # the flush; the run alone; flush + run

    active = type("Driver", (), {"get_empty_cache_for_benchmark": staticmethod(lambda: cache)})
    monkeypatch.setattr(triton.runtime, "driver", type("Drivers", (), {"active": active}))
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", do_bench_cudagraph)
    monkeypatch.setattr(tuning, "_FLUSH_MS", {})
    assert tuning.gpu_time(run) == pytest.approx(0.04)


@requires_cuda
@pytest.mark.cuda
def test_candidates_are_timed_from_a_cuda_graph(monkeypatch):
    """GPU time alone: a candidate that allocates and launches is captured and replayed, without the
    Python-timed fallback."""
    import triton.testing

    def no_fallback(*args, **kwargs):
        raise AssertionError("timed from Python")

    monkeypatch.setattr(triton.testing, "do_bench", no_fallback)
    x = torch.randn(512, 512, device="cuda")
    assert 0 < tuning.gpu_time(lambda: (x @ x).relu()) < 1.0


@requires_cuda
@pytest.mark.cuda
def test_traced_op_is_tuned_on_stand_ins(cache_dir, monkeypatch):
    """Traced (fake arguments), the op is tuned on real stand-ins of the same shapes. Candidates: no TMA
    (alignment is unknown), and cuBLAS only where the global TF32 flag gives the precision asked for."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(op.CHAIN, "_chosen", {})
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    ieee = lambda a: dataclasses.replace(a, kernel=KernelOptions(fp32_matmul="ieee"))  # noqa: E731
    with FakeTensorMode():
        args = make_args(256, 128, 96, device="cuda")
        traced = choice.candidates(args, choice.problem(args, True), traced=True)
        assert not any(name.endswith(" tma") for name in traced) and "cublas" in traced
        assert list(choice.candidates(ieee(args), choice.problem(ieee(args), True), traced=True)) == ["cublas"]
        chosen = op.CHAIN.choose(args, traced=True)
    assert chosen in traced.values()
    [key] = json.loads((cache_dir / "tuning.json").read_text())
    assert key.endswith(" traced")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    with FakeTensorMode():
        assert choice.candidates(ieee(args), choice.problem(ieee(args), True), traced=True) == {}


@requires_cuda
@pytest.mark.cuda
def test_timing_waits_for_the_work_queued_on_the_callers_stream():
    """x.double() is freed as soon as the GEMM reading it is queued, and the flush buffer gpu_time allocates
    next may be carved from its block; zeroed on do_bench_cudagraph's own stream without waiting, it changed
    the GEMM's input under it (relative error 2e-2 to 3e-2 against the same GEMM run again, H100). Three
    rounds: the first, in a fresh process, found no freed block to reuse."""
    for _ in range(3):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(16384, 4096, device="cuda", generator=g)
        w = torch.randn(4096, 4096, device="cuda", generator=g)
        product = torch.nn.functional.linear(x.double(), w.double())  # about 10 ms of fp64 GEMM still queued
        tuning.gpu_time(lambda: x.sum())
        again = torch.nn.functional.linear(x.double(), w.double())
        assert ((product - again).norm() / again.norm()).item() < 1e-12
