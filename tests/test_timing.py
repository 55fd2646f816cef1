"""Each match timed against Inductor's own code for its nodes (fusepass/timing.py): the faster runs.

On CPU nothing is timed (the timing is CUDA's), so these tests let it run there with a stand-in for the
tuner's clock: both candidates are still compiled and run, forward and backward, and the verdict,
the counters, the report and the model's results are real. Its last test times for real, on CUDA."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import fusepass
from fusepass import timing
from fusepass.families import FAMILIES
from fusepass.matcher import find_chains
from fusepass.lowering import tuning
from fusepass.sync_batch_norm import sync_batch_norm
from tests.chains import ChainModel, Trio, assert_fused, fusepass_stats, make_input, requires_cuda


TIMED = {"time_unfused": True}


class Clock:
    """Replaces the tuner's timing: runs each candidate once (as the tuner does before timing it) and
    reports the given times; keeps what each run returned."""

    def __init__(self, fused_ms: float, unfused_ms: float):
        self.times = {timing.FUSED: fused_ms, timing.UNFUSED: unfused_ms}
        self.runs: list[tuple[str, list]] = []

    def __call__(self, candidates: dict, clock=None, parallel_on=None) -> dict:
        for name, run in candidates.items():
            self.runs.append((name, list(run())))
        return {name: self.times[name] for name in candidates}


@pytest.fixture
def clock(monkeypatch):
    """Timing as on CUDA (FUSEPASS_TUNE=1, CPU tensors allowed), with a clock each test sets."""
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    monkeypatch.setattr(timing, "_why_not_timed", lambda match: None)
    made = []

    def make(fused_ms, unfused_ms):
        made.append(Clock(fused_ms, unfused_ms))
        monkeypatch.setattr(tuning, "_time_candidates", made[-1])
        return made[-1]
    return make


def _train_and_eval_steps(trio: Trio, batch: int = 13) -> None:
    for training in (True, False):
        trio.train(training)
        trio.step(make_input(batch, 32))
    trio.finish()


def test_unfused_faster_leaves_the_chain_to_inductor(clock, caplog):
    timed = clock(fused_ms=2.0, unfused_ms=1.0)
    # No linear bias and no pre-batch-norm scale: their gradients are rounding noise (tests/chains.py),
    # and unfused they are Inductor's noise, no nearer float64 than eager's on every draw.
    trio = Trio.of(ChainModel(bias=False, scale=None, softmax="functional"), TIMED, zero_grads=(), float64_grads=())
    with caplog.at_level(logging.INFO, logger="fusepass"):
        _train_and_eval_steps(trio)
    assert fusepass_stats().get("unfused") == 2  # the training graph's chain and the eval graph's
    assert_fused(rewrites=0, graphs=2)
    # Train and eval (both with gradients, as Trio runs them) are two problems; each candidate ran forward
    # and backward: the output and 4 gradients (x, W, gamma, beta).
    assert [(name, len(out)) for name, out in timed.runs] == [(timing.FUSED, 5), (timing.UNFUSED, 5)] * 2
    [report, _] = [r.args[0] for r in caplog.records if isinstance(r.args and r.args[0], fusepass.Report)]
    assert not report.matches
    assert [m["reason"] for m in report.misses] == [
        "left to Inductor, whose code for it measured faster "
        "(unfused (Inductor): timed unfused (Inductor) 1.000 ms, fused 2.000 ms)"]


def test_fused_faster_keeps_the_chain_fused_and_explain_shows_why(clock):
    clock(fused_ms=1.0, unfused_ms=3.0)
    model = ChainModel(bias=False, scale=None)  # Inductor's code must pass the numerical check to be timed
    x = make_input(16, 32).requires_grad_()  # as the training step's input: the same problem
    before = fusepass.explain(model, x)
    assert before.matches[0]["verdict"] == timing.NOT_YET_TIMED
    trio = Trio.of(model, TIMED)
    _train_and_eval_steps(trio, batch=16)
    assert_fused(rewrites=2, graphs=2)
    assert "unfused" not in fusepass_stats()
    # explain() in the same state as the training step: the tuning cache now holds the verdict.
    after = fusepass.explain(model, x)
    assert after.matches[0]["verdict"] == "fused: timed fused 1.000 ms, unfused (Inductor) 3.000 ms"
    assert "fused: timed fused 1.000 ms" in str(after)


def test_verdict_is_cached_and_each_chain_decided_on_its_own(clock, monkeypatch):
    """Two chains of different shapes: two verdicts. Compiled again from scratch: none timed again."""
    first = clock(fused_ms=1.0, unfused_ms=2.0)
    # Without the noise-only gradients (see above), so that Inductor's code is not refused as inexact.
    model = torch.nn.Sequential(ChainModel(32, 48, bias=False, scale=None), ChainModel(48, 16, bias=False, scale=None))
    x = make_input(12, 32)
    torch.compile(model, backend="fusepass", options=TIMED)(x)
    assert [name for name, _ in first.runs] == [timing.FUSED, timing.UNFUSED] * 2
    assert_fused(rewrites=2, graphs=1)
    torch._dynamo.reset()
    again = clock(fused_ms=5.0, unfused_ms=1.0)  # would flip the verdicts if anything were timed
    compiled = []
    monkeypatch.setattr(timing, "_compiled_step", lambda *args: compiled.append(1))
    torch.compile(model, backend="fusepass", options=TIMED)(x)
    assert again.runs == [] and compiled == []  # a cached verdict compiles no candidate
    assert_fused(rewrites=4, graphs=2)


@pytest.mark.parametrize("options", [None, {"time_unfused": False}])
def test_nothing_is_timed_by_default_or_with_time_unfused_false(clock, options):
    timed = clock(fused_ms=2.0, unfused_ms=1.0)
    torch.compile(ChainModel(), backend="fusepass", options=options)(make_input(8, 32))
    assert timed.runs == []
    assert_fused(rewrites=1, graphs=1)


def test_environment_variable_turns_it_on_and_an_explicit_option_wins(clock, monkeypatch):
    monkeypatch.setenv("FUSEPASS_TIME_UNFUSED", "1")
    timed = clock(fused_ms=1.0, unfused_ms=2.0)
    model, x = ChainModel(bias=False, scale=None), make_input(8, 32)
    torch.compile(model, backend="fusepass", options={"time_unfused": False})(x)
    assert timed.runs == []
    torch._dynamo.reset()
    torch.compile(model, backend="fusepass")(x)
    assert [name for name, _ in timed.runs] == [timing.FUSED, timing.UNFUSED]
    assert_fused(rewrites=2, graphs=2)


def test_a_race_that_fails_leaves_the_chain_fused(clock, monkeypatch, caplog):
    clock(fused_ms=2.0, unfused_ms=1.0)

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler today")
    monkeypatch.setattr(timing, "_compiled_step", broken)
    with caplog.at_level(logging.WARNING, logger="fusepass"):
        torch.compile(ChainModel(), backend="fusepass", options=TIMED)(make_input(8, 32))
    assert_fused(rewrites=1, graphs=1)
    assert any("no compiler today" in r.getMessage() and "stays fused" in r.getMessage() for r in caplog.records)


def test_not_timed_on_cpu_or_with_tuning_off(monkeypatch):
    model, x = ChainModel(), make_input(8, 32)
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    assert fusepass.explain(model, x).matches[0]["verdict"] == "fused: not timed against Inductor: not on CUDA"
    monkeypatch.setenv(tuning.TUNE_ENV, "0")
    assert fusepass.explain(model, x).matches[0]["verdict"] == "fused: not timed against Inductor: FUSEPASS_TUNE=0"


def test_a_sync_batch_norm_chain_is_never_timed(monkeypatch):
    """Timing either way would run SyncBatchNorm's collectives on the timing rank alone."""
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    synced = graph.call_function(sync_batch_norm, (x,))
    plain = graph.call_function(torch.nn.functional.batch_norm, (x,))
    assert timing._why_not_timed(SimpleNamespace(nodes=(x, synced))).startswith("a SyncBatchNorm chain")
    assert not timing._why_not_timed(SimpleNamespace(nodes=(x, plain))).startswith("a SyncBatchNorm chain")


def test_extract_computes_the_nodes_alone():
    """The extracted graph of a match gives what the match's nodes give in the whole graph."""
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward
    model, x = ChainModel(scale_after="single"), make_input(9, 32)
    model.eval()
    expected = torch.compile(model, backend=backend)(x)
    gm, example_inputs = captured[0]
    [match], _ = find_chains(gm.graph, FAMILIES)
    sub = timing.extract(gm, match.nodes)
    assert [n.op for n in sub.graph.nodes].count("output") == 1
    inputs = timing.stand_ins(gm, sub, example_inputs)
    assert any(t is not None and torch.equal(t, x) for t in inputs)  # a graph input: its own value
    [out] = sub(*inputs)
    torch.testing.assert_close(out, expected)


def test_a_candidate_further_from_float64_than_eager_is_refused():
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward
    x = make_input(16, 32).requires_grad_()
    torch.compile(ChainModel(), backend=backend)(x)
    gm, example_inputs = captured[0]
    [match], _ = find_chains(gm.graph, FAMILIES)
    sub = timing.extract(gm, match.nodes)
    inputs = timing.stand_ins(gm, sub, example_inputs)
    upstream = timing._upstream_gradients(sub)
    eager = timing._step(sub, inputs, upstream)
    assert timing._further_than_eager(sub, inputs, upstream, lambda: eager) is None
    off = [t.clone() for t in eager]
    off[2] = off[2] * (1 + 1e-4)  # the gradient of W, 1e-4 off: far above fp32 rounding
    assert timing._further_than_eager(sub, inputs, upstream, lambda: off).startswith("gradient 1: ")


def test_bad_option_value():
    with pytest.raises(Exception, match="time_unfused"):
        torch.compile(ChainModel(), backend="fusepass", options={"time_unfused": "yes"})(make_input(4, 32))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.slow
def test_on_cuda_both_are_timed_and_the_model_stays_exact(monkeypatch):
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    timed_before = set(tuning.TUNER.timings)
    trio = Trio.of(ChainModel(256, 384, bias=False, scale=None, softmax="functional").cuda(), TIMED,
                   zero_grads=(), float64_grads=())
    for training in (True, False):
        trio.train(training)
        trio.step(make_input(500, 256, "cuda"))
    trio.finish()
    stats = fusepass_stats()
    assert stats.get("rewrites", 0) + stats.get("unfused", 0) == 2 and not stats.get("fallbacks")
    raced = [times for problem, times in tuning.TUNER.timings.items()
             if problem.startswith("timed ") and problem not in timed_before]
    assert len(raced) == 2  # train and eval, each timed on the GPU
    assert all(set(times) == {timing.FUSED, timing.UNFUSED} and min(times.values()) > 0 for times in raced)


def test_a_refusal_is_remembered_and_nothing_compiled_again(clock, monkeypatch):
    timed = clock(fused_ms=2.0, unfused_ms=1.0)
    checks = []
    monkeypatch.setattr(timing, "_further_than_eager", lambda *args: checks.append(1) or "gradient 1: 1e-3 to 1e-6")
    model, x = ChainModel(), make_input(8, 32)
    torch.compile(model, backend="fusepass", options=TIMED)(x)
    torch._dynamo.reset()
    compiled = []
    monkeypatch.setattr(timing, "_compiled_step", lambda *args: compiled.append(1))
    torch.compile(model, backend="fusepass", options=TIMED)(x)
    assert checks == [1] and compiled == [] and timed.runs == []
    assert_fused(rewrites=2, graphs=2)
