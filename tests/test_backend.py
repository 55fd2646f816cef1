"""End to end: torch.compile(backend="fusepass") against eager and a float64 copy of the model."""

import importlib.metadata
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import fusepass.backend
import fusepass.lowering.linear_scale_batch_norm as lowering
from fusepass.backend import FusepassFallbackWarning
from tests.chains import DEVICES, ChainModel, Trio, fusepass_stats, make_input

VARIANTS = {
    "per_feature": {},
    "no_bias": {"bias": False},
    "scale_first_torch_mul": {"scale_first": True, "torch_mul": True},
    "single_scale": {"scale": "single"},
    "zero_dim_scale": {"scale": "zero_dim", "scale_first": True},
    "number_scale": {"scale": "number", "torch_mul": True},
    "no_affine": {"affine": False},
    "no_running_stats": {"track_running_stats": False},
    "momentum_0.3_eps_1e-3": {"momentum": 0.3, "eps": 1e-3},
}


# Softmax chains with a one-element scale after batch norm: that scale's gradient is one heavy-tailed
# sample of rounding noise per step (fusepass's and eager's errors each span two orders of magnitude;
# over 36 bf16 steps fusepass's RMS error was 0.033, eager's 0.078), so these runs take enough steps
# for the criterion over all steps (tests/chains.py) to mean something.
NOISY_SCALAR_STEPS = 24


def run_train_then_eval(model, device, *, steps=8, batch=64, autocast_dtype=None, options=None):
    trio = Trio.of(model.to(device), options=options)
    for training in (True, False):
        trio.train(training)
        for _ in range(steps if training else 1):
            trio.step(make_input(batch, model.linear.in_features, device), autocast_dtype=autocast_dtype)
    trio.finish()
    return trio


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_eager_by_float64_criterion(variant, device):
    torch.manual_seed(0)
    run_train_then_eval(ChainModel(**VARIANTS[variant]), device)
    # One graph for training, one for eval, each with exactly one rewrite.
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


FAMILY_VARIANTS = {
    "bare": {"scale": None},
    "scale_after": {"scale": None, "scale_after": "single", "scale_first": True},
    "scale_softmax_module": {"scale": None, "scale_after": "single", "softmax": "module"},
    "all_steps": {"scale_after": "per_feature", "softmax": "functional"},
    "softmax_dtype_number_scale": {"scale": "zero_dim", "scale_after": "number", "softmax": "dtype"},
    "softmax_plain_batch_norm": {"scale": None, "softmax": "method", "affine": False,
                                 "track_running_stats": False},
    # Softmax over the batch dim cancels every per-feature shift exactly, so the gradients of biases
    # (batch norm's, and in eval the linear's) are exactly 0: rounding noise in eager and fusepass alike.
    "softmax_dim0_left_out": {"scale_after": "per_feature", "softmax": "dim0", "affine": False, "bias": False},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_family_members_match_eager_by_float64_criterion(variant, device):
    torch.manual_seed(10)
    kwargs = FAMILY_VARIANTS[variant]
    noisy = kwargs.get("softmax") and kwargs.get("scale_after") in ("single", "zero_dim")
    run_train_then_eval(ChainModel(**kwargs), device, steps=NOISY_SCALAR_STEPS if noisy else 8)
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_softmax_chain(dtype, device):
    torch.manual_seed(11)
    run_train_then_eval(ChainModel(scale=None, scale_after="single", softmax="module").to(dtype), device,
                        steps=NOISY_SCALAR_STEPS)
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_softmax_chain(device):
    torch.manual_seed(12)
    run_train_then_eval(ChainModel(scale=None, scale_after="single", softmax="module"), device,
                        steps=NOISY_SCALAR_STEPS, autocast_dtype=torch.bfloat16)
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model(dtype, device):
    torch.manual_seed(1)
    run_train_then_eval(ChainModel().to(dtype), device)
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale, dtype", [("per_feature", torch.bfloat16), ("zero_dim", torch.bfloat16),
                                          ("per_feature", torch.float16)])
def test_autocast(scale, dtype, device):
    """The linear runs in the autocast dtype as in eager; the output dtype follows eager's promotion
    (fp32 for a per-feature fp32 scale, the autocast dtype for a 0-d one)."""
    torch.manual_seed(2)
    run_train_then_eval(ChainModel(scale=scale), device, autocast_dtype=dtype)
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


@pytest.mark.parametrize("device", DEVICES)
def test_changing_batch_size(device):
    """Dynamo's automatic dynamic shapes: the second batch size recompiles with a symbolic batch."""
    torch.manual_seed(3)
    trio = Trio.of(ChainModel().to(device))
    for batch in (8, 13, 5, 21):
        trio.step(make_input(batch, 32, device))
    trio.finish()
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


def test_momentum_none_is_correct_and_fused_only_without_graph_break():
    """nn.BatchNorm1d with momentum=None computes 1/num_batches_tracked with float(tensor) in training:
    a Dynamo graph break that puts batch_norm in a graph of its own, before any backend sees it, and
    Dynamo keeps that split for eval too. Compiled fresh in eval mode there is no break: one rewrite."""
    torch.manual_seed(4)
    # No pre-BN scale and no linear bias: unfused, their training gradients (exactly ~0) would compare
    # Inductor's rounding noise with eager's, which says nothing about fusepass.
    run_train_then_eval(ChainModel(momentum=None, scale=None, bias=False), "cpu")
    assert fusepass_stats()["rewrites"] == 0

    torch._dynamo.reset()
    trio = Trio.of(ChainModel(momentum=None))
    trio.train(False)
    trio.step(make_input(16, 32))
    trio.finish()
    assert fusepass_stats()["rewrites"] == 1


def test_no_grad_inference_keeps_no_linear_output():
    torch.manual_seed(5)
    model = ChainModel().eval()
    trio = Trio.of(model)
    trio.train(False)
    with torch.no_grad():
        trio.step(make_input(9, 32))
    trio.finish()
    assert fusepass_stats() == {"graphs": 1, "rewrites": 1}


def test_batch_of_one_in_training_fails_like_eager():
    model = ChainModel()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        model(make_input(1, 32))
    # Dynamo runs batch_norm on fake tensors while tracing, before any backend, and reports eager's error.
    with pytest.raises(Exception, match="Expected more than 1 value per channel when training"):
        torch.compile(ChainModel(), backend="fusepass")(make_input(1, 32))


# --------------------------------------------------------------------------- registration and options


def test_backend_is_registered_by_entry_point():
    [entry] = [e for e in importlib.metadata.entry_points(group="torch_dynamo_backends") if e.name == "fusepass"]
    assert entry.value == "fusepass.backend:fusepass_backend"


def test_backend_works_by_name_without_import():
    code = (
        "import sys, torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))\n"
        "out = torch.compile(m, backend='fusepass')(torch.randn(4, 6))\n"
        "assert out.shape == (4, 5) and 'fusepass.backend' in sys.modules\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def _capture_compile_fx(monkeypatch):
    calls = []
    real = fusepass.backend.compile_fx

    def spy(gm, example_inputs, config_patches=None):
        calls.append(dict(config_patches or {}))
        return real(gm, example_inputs, config_patches=config_patches)

    monkeypatch.setattr(fusepass.backend, "compile_fx", spy)
    return calls


def test_mode_is_forwarded_to_inductor(monkeypatch):
    calls = _capture_compile_fx(monkeypatch)
    model = ChainModel()
    out = torch.compile(model, backend="fusepass", mode="max-autotune-no-cudagraphs")(make_input(6, 32))
    assert out.shape == (6, 48)
    assert calls and calls[0]["max_autotune"] is True and calls[0]["coordinate_descent_tuning"] is True


@pytest.mark.parametrize("device", DEVICES)
def test_reduce_overhead_mode_runs(device):
    """On CUDA this captures the fused op in CUDA graphs."""
    torch.manual_seed(6)
    trio = Trio.of(ChainModel().to(device), mode="reduce-overhead")
    for _ in range(3):
        trio.step(make_input(8, 32, device))
    trio.finish()
    assert fusepass_stats()["rewrites"] == 1


def test_inductor_options_are_forwarded(monkeypatch):
    calls = _capture_compile_fx(monkeypatch)
    torch.compile(ChainModel(), backend="fusepass", options={"epilogue_fusion": False})(make_input(6, 32))
    assert calls[0]["epilogue_fusion"] is False


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(Exception) as info:
        torch.compile(ChainModel(), backend="fusepass", options={"debug_dri": "/tmp/x"})(make_input(6, 32))
    message = str(info.value)
    assert "unknown option 'debug_dri'" in message
    assert "debug_dir" in message and "fallback" in message and "torch._inductor.config" in message


def test_bad_fallback_value_is_rejected():
    with pytest.raises(Exception, match="fallback"):
        torch.compile(ChainModel(), backend="fusepass", options={"fallback": "nope"})(make_input(6, 32))


@pytest.mark.parametrize("fallback", ["inductor", "eager"])
def test_failed_rewrite_falls_back_with_one_warning(monkeypatch, fallback):
    def broken_rewrite(gm, *args):
        raise RuntimeError("simulated rewrite failure")

    monkeypatch.setattr(fusepass.backend, "rewrite", broken_rewrite)
    torch.manual_seed(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trio = Trio.of(ChainModel(), options={"fallback": fallback})
        for _ in range(2):
            trio.step(make_input(8, 32))
        trio.finish()
    fallback_warnings = [w for w in caught if issubclass(w.category, FusepassFallbackWarning)]
    assert len(fallback_warnings) == 1
    assert "simulated rewrite failure" in str(fallback_warnings[0].message)
    assert f"falls back to {fallback}" in str(fallback_warnings[0].message)
    assert fusepass_stats()["fallbacks"] == 1


def test_fused_op_failing_at_first_call_falls_back_without_double_update(monkeypatch):
    """The op compiles (its fake is fine) but its kernel fails when first run: the graph switches to
    plain Inductor and the running statistics are updated exactly once, as in eager."""
    def broken_kernel(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(lowering, "reference", broken_kernel)
    torch.manual_seed(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trio = Trio.of(ChainModel())
        for _ in range(2):
            trio.step(make_input(8, 32))
        trio.finish()
    messages = [str(w.message) for w in caught if issubclass(w.category, FusepassFallbackWarning)]
    assert len(messages) == 1 and "simulated kernel failure" in messages[0]
    assert torch.equal(trio.fused.bn.num_batches_tracked, trio.eager.bn.num_batches_tracked)


# --------------------------------------------------------------------------- each GEMM implementation on a GPU

CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("gemm", ["triton", "cublas"])
@pytest.mark.parametrize("precision", ["fp32", "fp32-ieee", "tf32", "bf16-autocast"])
@pytest.mark.parametrize("tail", ["bn", "scale_softmax"])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA_ONLY)], ids=["cuda"])
def test_each_gemm_implementation_end_to_end(gemm, precision, tail, _):
    """Shapes that are no multiple of any tile; training then eval, outputs, buffers, gradients."""
    torch.manual_seed(11)
    options = {"gemm": gemm, "fp32_matmul": "ieee" if precision == "fp32-ieee" else "tf32x3"}
    model = ChainModel(96, 80, scale_after="per_feature" if tail == "scale_softmax" else None,
                       softmax="functional" if tail == "scale_softmax" else None)
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:  # set and restored by hand: pytest's monkeypatch fails to restore this module attribute
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        run_train_then_eval(model, "cuda", steps=3, batch=72, options=options,
                            autocast_dtype=torch.bfloat16 if precision == "bf16-autocast" else None)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert fusepass_stats()["rewrites"] >= 1


def test_kernel_options_are_validated():
    with pytest.raises(Exception, match="fp32_matmul"):
        torch.compile(ChainModel(), backend="fusepass", options={"fp32_matmul": "fp16"})(make_input(6, 32))
    with pytest.raises(Exception, match="gemm"):
        torch.compile(ChainModel(), backend="fusepass", options={"gemm": "cutlass"})(make_input(6, 32))


OPAQUE_CALL = "= torch.ops.fusepass.linear_scale_batch_norm_opaque.default("


def _compiled_code(model, *inputs) -> str:
    """Inductor's generated code for one forward of `model` compiled by fusepass."""
    from torch._inductor.utils import run_and_get_code
    _out, code = run_and_get_code(torch.compile(model, backend="fusepass"), *inputs)
    return "\n".join(code)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False])
def test_where_the_fused_op_runs_in_the_compiled_graph(device, training):
    """On CUDA the op's body is traced (a triton_op): Inductor launches its Triton kernels itself and
    no opaque call is left. On CPU the op stays one opaque call to the PyTorch reference."""
    torch.manual_seed(5)
    model = ChainModel(softmax="functional").to(device).train(training)
    code = _compiled_code(model, make_input(16, 32, device))
    if device == "cuda":
        assert "linear_scale_batch_norm_opaque" not in code
        kernels = ("_linear_epilogue_kernel", "_normalize_softmax_kernel", "_partial_stats_kernel")
        assert any(name in code for name in kernels)
    else:
        assert code.count(OPAQUE_CALL) == 1
    assert fusepass_stats() == {"graphs": 1, "rewrites": 1}


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA_ONLY)], ids=["cuda"])
def test_autocast_weight_is_cast_into_one_buffer(training, _):
    """Traced on CUDA under autocast, the Triton GEMM gets the bf16 weight once. (It used to get the
    same tensor for its unused low-half operand too, and Inductor then wrote the cast into two
    buffers: a second full copy of W.)"""
    torch.manual_seed(7)
    model = ChainModel(32, 48).cuda().train(training)
    compiled = torch.compile(model, backend="fusepass", options={"gemm": "triton"})
    from torch._inductor.utils import run_and_get_code
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _out, code = run_and_get_code(compiled, make_input(16, 32, "cuda"))
    forward = code[0]
    assert "_linear_epilogue_kernel" in forward
    assert forward.count("empty_strided_cuda((48, 32), (32, 1), torch.bfloat16)") == 1


@pytest.mark.parametrize("gemm, kernels", [("triton", ["_linear_epilogue_kernel", "_normalize_softmax_kernel"]),
                                           ("cublas", ["_normalize_softmax_kernel"])])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA_ONLY)], ids=["cuda"])
def test_traced_softmax_chain_launches_only_its_own_kernels(gemm, kernels, _):
    """Eval without grad, fp32: Inductor launches the op's kernels (and cuBLAS) and nothing else. It used
    to add a copy of the linear output, which the softmax pass wrote over, and a kernel copying the
    statistics, which shared a tensor with the pass's empty slots."""
    torch.manual_seed(8)
    model = ChainModel(256, 512, softmax="functional").cuda().eval()
    compiled = torch.compile(model, backend="fusepass", options={"gemm": gemm})
    from torch._inductor.utils import run_and_get_code
    with torch.no_grad():
        _out, code = run_and_get_code(compiled, make_input(128, 256, "cuda"))
    launched = [re.sub(r"_\d+$", "", name) for name in re.findall(r"(\w+)\.run\(", code[0])]
    assert launched == kernels


@pytest.mark.parametrize("device", DEVICES)
def test_symbolic_batch_uses_the_opaque_op(device):
    """A symbolic batch size cannot be tuned for at compile time: the op chooses when it runs."""
    torch.manual_seed(6)
    model = ChainModel().to(device)
    x = make_input(8, 32, device)
    torch._dynamo.mark_dynamic(x, 0)
    code = _compiled_code(model, x)
    assert code.count(OPAQUE_CALL) == 1
    assert fusepass_stats() == {"graphs": 1, "rewrites": 1}
