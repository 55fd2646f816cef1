"""What a fused training step holds: the tensors it saves for its backward (CPU: every saved tensor's
shape and dtype, through autograd's saved-tensor hooks), the buffers its compiled backward allocates
(CPU: Inductor's generated code), and on a GPU its peak memory against Inductor's and eager's step."""

import copy
import re
from contextlib import nullcontext

import pytest
import torch
import torch._dynamo
import torch.nn as nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_fw_bw_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

import fusepass  # noqa: F401  (registers the backend)
from fusepass.lowering import blocks, launch
from tests.chains import MLP, ChainModel, assert_fused, make_input, requires_cuda
from tests.test_tail import TailModel

N = 37  # rows: no other dimension of the models below is 37


def saved_tensors(model: nn.Module, x: torch.Tensor, autocast: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor the compiled model's forward saves for its backward."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, torch.bfloat16) if autocast else nullcontext():
            out = model(x)
    out.float().sum().backward()
    return saved


def batch_sized(saved, dtype=None) -> list[tuple[int, ...]]:
    """The saved 2-D tensors with a row per input row (of `dtype`, if given) as (rows, columns), sorted: a
    transposed view (x for the weight gradient) counts as the tensor it views."""
    return sorted((N, shape[1 - shape.index(N)]) for shape, t in saved
                  if len(shape) == 2 and N in shape and (dtype is None or t == dtype))


@pytest.mark.parametrize("autocast", [False, True])
def test_a_relu_mlp_saves_each_layer_input_and_linear_output_once(autocast):
    """Per chain Linear -> BatchNorm1d -> ReLU: its linear output and its output, which is also the next
    layer's input (one tensor, saved once); the first layer's input; nothing else a batch long."""
    torch.manual_seed(0)
    model = torch.compile(MLP(24, [40, 48, 8]), backend="fusepass")
    saved = saved_tensors(model, make_input(N, 24), autocast)
    assert_fused(rewrites=2)
    assert batch_sized(saved) == [(N, 24), (N, 40), (N, 40), (N, 48), (N, 48)]
    if autocast:  # the input's cast, the layers' linear outputs and outputs, all bf16
        assert batch_sized(saved, torch.bfloat16) == batch_sized(saved)


@pytest.mark.parametrize("model, rows", [
    (ChainModel(24, 40), [(N, 24), (N, 40)]),  # x, the linear output; not the output
    (ChainModel(24, 40, softmax="functional"), [(N, 24), (N, 40), (N, 40)]),  # and the probabilities
    (TailModel("gelu_relu", 24, 40), [(N, 24), (N, 40)]),  # the tail is rebuilt from the linear output
])
def test_a_chain_saves_its_input_its_linear_output_and_what_its_backward_reads(model, rows):
    torch._dynamo.reset()
    torch.manual_seed(1)
    compiled = torch.compile(model, backend="fusepass")
    saved = saved_tensors(compiled, make_input(N, 24), autocast=False)
    assert_fused(rewrites=1)
    assert batch_sized(saved) == rows


def test_a_relu_chain_backward_allocates_no_fp32_batch_buffer_under_autocast():
    """The relu's mask comes from the saved output: Inductor's backward keeps no (N, F) fp32 gradient
    (rebuilt from y and the per-feature vectors, it would store it for the kernels that read it)."""
    torch.manual_seed(2)
    model = torch.compile(MLP(24, [40, 48, 8]), backend="fusepass")
    x = make_input(N, 24)

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            return model(x).float().sum()

    _, (forward_code, backward_code) = run_fw_bw_and_get_code(step)
    batch_buffers = re.findall(rf"empty_strided_cpu\(\({N}, (\d+)\), \(\d+, 1\), torch\.(\w+)\)", backward_code)
    assert batch_buffers and ("40", "float32") not in batch_buffers and ("48", "float32") not in batch_buffers


def test_an_fp32_relu_mlp_backward_frees_each_layer_input_before_its_input_gradient():
    """fp32: each relu's mask is rebuilt from the linear output and stored in one byte per element (no
    (N, F) fp32 gradient buffer), and each layer's weight gradient comes before its input gradient, so
    that the layer's input (the layer before's output, which no mask reads now) is freed in between."""
    torch.manual_seed(2)
    model = torch.compile(MLP(24, [40, 48, 8]), backend="fusepass")
    _, (forward_code, backward_code) = run_fw_bw_and_get_code(lambda: model(make_input(N, 24)).sum())
    batch_buffers = re.findall(rf"empty_strided_cpu\(\({N}, (\d+)\), \(\d+, 1\), torch\.(\w+)\)", backward_code)
    assert sorted(batch_buffers) == [("40", "bool"), ("48", "bool")]
    lines = backward_code.splitlines()
    gemm = re.compile(rf"= torch\.ops\.fusepass\.linear_opaque\.default\((reinterpret_tensor\(\w+, \(\d+, {N}\))?"
                      r"[^,]*(?:, \([^)]*\), \d+\))?, (\w+)")
    calls = [(i, m) for i, line in enumerate(lines) if (m := gemm.search(line))]
    # a weight gradient's first operand is the (N, F) gradient seen as (F, N); the first layer has no dX
    assert ["dW" if m[1] else "dX" for _, m in calls] == ["dW", "dX", "dW", "dX", "dW"]
    for (at, weight_grad), (next_at, _) in zip(calls[0::2], calls[1::2]):
        assert f"del {weight_grad[2]}" in [line.strip() for line in lines[at:next_at]]


# --------------------------------------------------------------------------- on a GPU


def step_peak(model: nn.Module, x: torch.Tensor, autocast: bool) -> int:
    """Bytes a training step (forward, backward of the sum, an SGD step) allocates above what is held
    before it, after two warm-up steps (compiles and tuning)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16) if autocast else nullcontext():
            out = model(x)
        out.float().sum().backward()
        optimizer.step()

    step(), step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def step_peaks(make_model, x: torch.Tensor, autocast: bool) -> dict[str, int]:
    """step_peak of eager, Inductor and fusepass, each on its own copy of the same model."""
    torch.manual_seed(3)
    base = make_model().cuda()
    peaks = {}
    for name, backend in (("eager", None), ("inductor", "inductor"), ("fusepass", "fusepass")):
        torch._dynamo.reset()
        model = make_model().cuda()
        model.load_state_dict(base.state_dict())
        peaks[name] = step_peak(torch.compile(model, backend=backend) if backend else model, x, autocast)
        del model
        torch.cuda.empty_cache()
    return peaks


@requires_cuda
@pytest.mark.cuda
def test_a_relu_mlp_under_autocast_on_cuda_rebuilds_each_layer_output_in_the_backward():
    """Where the op's kernels are traced (CUDA), the partitioner rebuilds each chain's 16-bit output in
    the backward (lowering/recompute.py): the forward saves the first layer's input and each layer's
    linear output only; with rebuild_outputs=False the outputs too, as on CPU. The gradients are the
    same bits either way: the rebuild is the forward's own pass on the same saved values."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    base = MLP(24, [40, 48, 8]).cuda()
    x = make_input(N, 24, "cuda")
    grads = {}
    for rebuild_outputs, outputs in ((True, []), (False, [(N, 40), (N, 48)])):
        counters["fusepass"].clear()
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend="fusepass", options={"rebuild_outputs": rebuild_outputs})
        saved = saved_tensors(compiled, x, autocast=True)
        assert_fused(rewrites=2)
        assert batch_sized(saved) == sorted([(N, 24), (N, 40), (N, 48)] + outputs)
        grads[rebuild_outputs] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_a_fused_chain_step_peaks_below_inductors_and_eagers_on_cuda(autocast):
    """Linear -> * scale -> BatchNorm1d, 32768 x 4096 -> 4096: the fused backward makes its input gradient
    in one pass over one (N, F) buffer, where Inductor's and eager's backward hold more. (Wide enough
    that no fp32 GEMM splits a batch-long operand into tf32 halves in memory: linear.SPLIT_COPY_LIMIT.)"""
    peaks = step_peaks(lambda: ChainModel(4096, 4096), torch.randn(32768, 4096, device="cuda"), autocast)
    assert peaks["fusepass"] < 0.9 * peaks["inductor"] and peaks["fusepass"] < peaks["eager"], peaks


@requires_cuda
@pytest.mark.cuda
def test_a_fused_relu_mlp_step_peaks_with_inductors_under_autocast_on_cuda():
    """torchvision's MLP with BatchNorm1d, bf16 autocast: each chain keeps its linear output and its
    output, as Inductor's graph does (the relu's mask from the output; rebuilt instead, an fp32 gradient
    buffer put fusepass 19% above Inductor at 262144 rows on an H100)."""
    peaks = step_peaks(lambda: MLP(512, [2048, 2048, 256]), torch.randn(32768, 512, device="cuda"), autocast=True)
    assert peaks["fusepass"] < 1.02 * peaks["inductor"] and peaks["fusepass"] < peaks["eager"], peaks


@requires_cuda
@pytest.mark.cuda
def test_a_fused_fp32_relu_mlp_step_peaks_below_eagers_on_cuda():
    """fp32, the benchmark's MLP: each relu's mask is rebuilt from the linear output into one byte per
    element and each layer's input is freed after its weight gradient, before its input gradient is made.
    Below eager's step with the untuned choices the suite runs (tuning off: 396 MiB own against eager's
    456 and Inductor's 329, H100); tuned, as BENCHMARKS.md runs it, 321 MiB."""
    peaks = step_peaks(lambda: MLP(1024, [4096, 4096, 256]), torch.randn(4096, 1024, device="cuda"), autocast=False)
    assert peaks["fusepass"] < peaks["eager"], peaks


def tf32_chain_code(in_features: int, out_features: int, seed: int) -> tuple[str, str]:
    """The generated forward and backward code of a compiled ChainModel's training step at 320 rows, x with
    a gradient, TF32 allowed (set and restored by hand), the chain fused."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = torch.compile(ChainModel(in_features, out_features).cuda(), backend="fusepass")
    x = torch.randn(320, in_features, device="cuda", requires_grad=True)
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        _, (forward_code, backward_code) = run_fw_bw_and_get_code(lambda: model(x).sum())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert_fused(rewrites=1)
    return forward_code, backward_code


@requires_cuda
@pytest.mark.cuda
def test_a_tf32_backwards_roundings_are_made_in_the_backward_on_cuda():
    """TF32, tuning off: the chain's forward GEMM rounds in registers (its first candidate), and each
    backward GEMM rounds its transposed operand in memory (round_w, the first candidate there): x^T for
    the weight gradient, W^T for the input gradient. Those roundings read only what the forward has; they
    must stay in the backward beside their GEMMs, not be made in the forward and held until the backward
    (tf32_split.split_tf32's `after`)."""
    forward_code, backward_code = tf32_chain_code(256, 192, seed=4)
    assert "_tf32_split_kernel" not in forward_code
    assert "_tf32_split_kernel" in backward_code


@requires_cuda
@pytest.mark.cuda
def test_a_blocked_gemms_roundings_are_each_made_after_the_block_before_on_cuda(monkeypatch):
    """TF32, tuning off, copies bounded to one column tile of W's rows: each backward GEMM rounds its
    transposed operand (round_w) in several blocks, into one workspace (run_in_blocks). Traced, each block's
    rounding comes after the GEMM of the block before, which read the workspace, and all blocks' roundings
    share one buffer: blocks of their own were all allocated before the first GEMM."""
    monkeypatch.setenv("FUSEPASS_TUNE", "0")
    monkeypatch.setattr(blocks, "COPY_BYTES", 1)
    monkeypatch.setattr(blocks, "BLOCK_WAVES", 0)
    _, backward_code = tf32_chain_code(512, 384, seed=6)
    launches = [(m[1], launch_arguments(line[m.end():])) for line in backward_code.splitlines()
                if (m := re.search(r"(_tf32_split_kernel|_gemm_kernel)\w*\.run\(", line))]
    kernels = [kernel for kernel, _ in launches]
    assert kernels.count("_tf32_split_kernel") >= 4, kernels  # dX's and dW's, two blocks or more each
    assert ("_tf32_split_kernel", "_tf32_split_kernel") not in set(zip(kernels, kernels[1:])), kernels
    roundings = {arguments[1] for kernel, arguments in launches if kernel == "_tf32_split_kernel"}
    assert len(roundings) == 2, roundings  # the rounded copy (the kernel's second argument): one per GEMM


def launch_arguments(text: str) -> list[str]:
    """The top-level arguments of a call whose opening parenthesis `text` follows."""
    arguments, depth, current = [], 0, ""
    for char in text:
        if char in "([":
            depth += 1
        elif char in ")]":
            if depth == 0:
                break
            depth -= 1
        if char == "," and depth == 0:
            arguments.append(current.strip())
            current = ""
        else:
            current += char
    return arguments + [current.strip()]


def test_stored_is_a_stride_preserving_store_when_traced_and_the_tensor_itself_in_eager():
    t = torch.randn(6, 5, requires_grad=True) * 2
    assert launch.stored(t) is t
    graph = make_fx(lambda u: launch.stored(u.t() * 3))(torch.randn(5, 6)).graph
    stores = [n for n in graph.nodes if n.target is torch.ops.prims.inductor_force_stride_order.default]
    assert len(stores) == 1 and tuple(stores[0].args[1]) == (1, 6)


@requires_cuda
@pytest.mark.cuda
def test_a_weight_gradient_reads_one_stored_gradient_on_cuda(monkeypatch):
    """fp32, tuning off, x without a gradient: the weight gradient's split kernel and its GEMM both take the
    chain's (N, F) gradient, which the backward stores once (unstored, Inductor copied it for each kernel
    argument: a swish chain at 1024 x 8192 -> 8192, its weight gradient in four blocks, held eight)."""
    monkeypatch.setenv("FUSEPASS_TUNE", "0")
    torch._dynamo.reset()
    torch.manual_seed(5)
    rows, in_features, features = 1024, 8192, 8192
    model = torch.compile(TailModel("bias_div_swish", in_features, features).cuda(), backend="fusepass")
    x = torch.randn(rows, in_features, device="cuda")
    _, (_, backward_code) = run_fw_bw_and_get_code(lambda: model(x).sum())
    assert_fused(rewrites=1)
    assert "_tf32_split_kernel" in backward_code and "_gemm_kernel" in backward_code
    gradient_buffers = re.findall(rf"empty_strided_cuda\(\(({rows}, {features}|{features}, {rows})\)", backward_code)
    assert len(gradient_buffers) <= 1, gradient_buffers
