"""Self-supervised and classifier training code as people write it, for tests/test_real_models.py.

Each system below follows the structure of a public training recipe (written here from the structure,
not copied): the parts fusepass meets in real code that its own chain tests do not have.

- DinoLike (DINO): a multi-crop wrapper that runs the backbone per crop resolution and concatenates the
  features (the head sees several batch sizes: all crops for the student, the two global ones for the
  teacher), a head of Linear -> BatchNorm1d -> GELU blocks, a bottleneck Linear, F.normalize and a
  weight-normed last layer without bias, a teacher with requires_grad=False updated by EMA on `.data`,
  and the centred, sharpened cross-entropy loss.
- MocoV3Like (MoCo v3): projector and predictor of Linear(bias=False) -> BatchNorm1d -> ReLU blocks (the
  projector's last BatchNorm1d affine=False), each applied to two views, a momentum encoder updated by
  `param.data = ...` inside forward under no_grad and run there in training mode, and the contrastive
  cross-entropy loss.
- BarlowTwinsLike (Barlow Twins): a projector applied to two views, one shared BatchNorm1d(affine=False)
  for both views' embeddings, the cross-correlation loss; its backbone is frozen (requires_grad=False)
  and so is one batch norm's affine weight.
- PointNetHead (PointNet's classifier): Linear -> BatchNorm1d -> ReLU, then Linear -> Dropout(p=0.4) ->
  BatchNorm1d -> ReLU: in eval the dropout is an identity and the chain is whole.

`TrainingRun` runs one system three times (eager, compiled with fusepass, float64) through the same
training steps and an eval forward, and checks everything by the project's criterion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.chains import _check_comparable, _check_exactly_zero, _check_errors, _errors, randomize_batch_norm


@dataclass(frozen=True)
class Sizes:
    batch: int  # rows per view or crop
    in_features: int  # what the backbone is fed
    hidden: int  # the backbone's output and the heads' hidden width
    out: int  # the embedding


CPU_SIZES = Sizes(batch=16, in_features=24, hidden=40, out=20)
CUDA_SIZES = Sizes(batch=1024, in_features=512, hidden=2048, out=1024)


def _init_linear(layer: nn.Linear, std: float = 0.02) -> None:
    nn.init.trunc_normal_(layer.weight, std=std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


def _randomized(bn: nn.BatchNorm1d) -> nn.BatchNorm1d:
    randomize_batch_norm(bn)
    return bn


# --------------------------------------------------------------------------- DINO


class TokenBackbone(nn.Module):
    """A stand-in for a ViT: per-token Linear and GELU, then the mean over the tokens and a LayerNorm."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.embed, self.norm = nn.Linear(in_features, out_features), nn.LayerNorm(out_features)

    def forward(self, tokens):
        return self.norm(F.gelu(self.embed(tokens)).mean(dim=1))


class DinoHead(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int, bottleneck_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim), _randomized(nn.BatchNorm1d(hidden_dim)), nn.GELU(),
            nn.Linear(hidden_dim, hidden_dim), _randomized(nn.BatchNorm1d(hidden_dim)), nn.GELU(),
            nn.Linear(hidden_dim, bottleneck_dim))
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                _init_linear(layer)
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCrop(nn.Module):
    """Runs the backbone once per run of crops of the same resolution (the number of tokens), then the
    head once on all their features concatenated."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops: list):
        resolutions = torch.tensor([crop.shape[1] for crop in crops])
        ends = torch.cumsum(torch.unique_consecutive(resolutions, return_counts=True)[1], 0)
        start, features = 0, torch.empty(0).to(crops[0].device)
        for end in ends:
            features = torch.cat((features, self.backbone(torch.cat(crops[start:end]))))
            start = end
        return self.head(features)


class DinoLoss(nn.Module):
    def __init__(self, out_dim: int, n_crops: int, student_temp: float = 0.1, teacher_temp: float = 0.04,
                 center_momentum: float = 0.9):
        super().__init__()
        self.n_crops, self.student_temp, self.teacher_temp = n_crops, student_temp, teacher_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student_output, teacher_output):
        student_out = (student_output / self.student_temp).chunk(self.n_crops)
        teacher_out = F.softmax((teacher_output - self.center) / self.teacher_temp, dim=-1).detach().chunk(2)
        total, terms = 0.0, 0
        for i, q in enumerate(teacher_out):
            for v, s in enumerate(student_out):
                if v != i:
                    total = total + torch.sum(-q * F.log_softmax(s, dim=-1), dim=-1).mean()
                    terms += 1
        with torch.no_grad():
            batch_center = teacher_output.sum(dim=0, keepdim=True) / len(teacher_output)
            self.center.copy_(self.center * self.center_momentum + batch_center * (1 - self.center_momentum))
        return total / terms


class DinoLike(nn.Module):
    """Student and teacher MultiCrop(TokenBackbone, DinoHead); two global crops of 4 tokens and two local
    crops of 2 tokens, each `batch` rows. The user compiles the student and the teacher."""

    compiled_parts = ("student", "teacher")
    # Each head Linear feeds a batch norm in training: its bias gradient is exactly 0 when fused.
    zero_grads = ("student.head.mlp.0.bias", "student.head.mlp.3.bias")

    def __init__(self, sizes: Sizes):
        super().__init__()
        self.sizes = sizes
        make = lambda: MultiCrop(TokenBackbone(sizes.in_features, sizes.hidden),  # noqa: E731
                                 DinoHead(sizes.hidden, sizes.out * 2, sizes.hidden * 2, sizes.out))
        self.student, self.teacher = make(), make()
        self.teacher.load_state_dict(self.student.state_dict())
        for p in self.teacher.parameters():
            p.requires_grad = False
        self.loss_fn = DinoLoss(sizes.out * 2, n_crops=4)

    def inputs(self, device) -> tuple:
        b, k = self.sizes.batch, self.sizes.in_features
        crops = [torch.randn(b, tokens, k, device=device) + 0.3 for tokens in (4, 4, 2, 2)]
        return (crops,)

    def loss(self, run, crops):
        teacher_output = run("teacher")(crops[:2])
        student_output = run("student")(crops)
        return self.loss_fn(student_output, teacher_output)

    def after_step(self) -> None:
        with torch.no_grad():  # the teacher's EMA, on .data as DINO writes it
            for ps, pt in zip(self.student.parameters(), self.teacher.parameters()):
                pt.data.mul_(0.996).add_((1 - 0.996) * ps.detach().data)

    def evaluate(self, run, crops):
        return run("student")(crops[:2])


# --------------------------------------------------------------------------- MoCo v3


def build_mlp(num_layers: int, input_dim: int, mlp_dim: int, output_dim: int, last_bn: bool = True) -> nn.Sequential:
    layers = []
    for i in range(num_layers):
        dim1 = input_dim if i == 0 else mlp_dim
        dim2 = output_dim if i == num_layers - 1 else mlp_dim
        layers.append(nn.Linear(dim1, dim2, bias=False))
        if i < num_layers - 1:
            layers += [_randomized(nn.BatchNorm1d(dim2)), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(_randomized(nn.BatchNorm1d(dim2, affine=False)))
    return nn.Sequential(*layers)


class Encoder(nn.Module):
    """A stand-in for a ResNet whose `fc` is replaced by the projector."""

    def __init__(self, in_features: int, hidden: int, fc: nn.Module):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.fc = fc

    def forward(self, x):
        return self.fc(self.body(x))


class MocoModule(nn.Module):
    def __init__(self, sizes: Sizes, temperature: float = 1.0):
        super().__init__()
        mlp_dim = sizes.hidden * 2
        self.temperature = temperature
        self.base_encoder = Encoder(sizes.in_features, sizes.hidden, build_mlp(2, sizes.hidden, mlp_dim, sizes.out))
        self.momentum_encoder = Encoder(sizes.in_features, sizes.hidden, build_mlp(2, sizes.hidden, mlp_dim, sizes.out))
        self.predictor = build_mlp(2, sizes.out, mlp_dim, sizes.out, last_bn=False)
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            param_m.data.copy_(param_b.data)
            param_m.requires_grad = False

    @torch.no_grad()
    def _update_momentum_encoder(self, m: float) -> None:
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            param_m.data = param_m.data * m + param_b.data * (1. - m)

    def contrastive_loss(self, q, k):
        q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
        logits = torch.einsum("nc,mc->nm", [q, k]) / self.temperature
        labels = torch.arange(logits.shape[0], dtype=torch.long, device=q.device)
        return nn.CrossEntropyLoss()(logits, labels) * (2 * self.temperature)

    def forward(self, x1, x2, m: float):
        q1 = self.predictor(self.base_encoder(x1))
        q2 = self.predictor(self.base_encoder(x2))
        with torch.no_grad():
            self._update_momentum_encoder(m)
            k1 = self.momentum_encoder(x1)
            k2 = self.momentum_encoder(x2)
        return self.contrastive_loss(q1, k2) + self.contrastive_loss(q2, k1)


class MocoV3Like(nn.Module):
    """The user compiles the MoCo module, momentum update and loss included; momentum 0.99, T = 1."""

    compiled_parts = ("moco",)
    zero_grads = ()  # no linear has a bias

    def __init__(self, sizes: Sizes):
        super().__init__()
        self.sizes = sizes
        self.moco = MocoModule(sizes)

    def inputs(self, device) -> tuple:
        x = torch.randn(self.sizes.batch, self.sizes.in_features, device=device)
        return x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)

    def loss(self, run, x1, x2):
        return run("moco")(x1, x2, 0.99)

    def after_step(self) -> None:
        pass

    def evaluate(self, run, x1, x2):
        return run("moco")(x1, x2, 0.99)


# --------------------------------------------------------------------------- Barlow Twins


class BarlowTwinsModule(nn.Module):
    def __init__(self, sizes: Sizes, lambd: float = 0.0051):
        super().__init__()
        self.lambd = lambd
        self.backbone = nn.Sequential(nn.Linear(sizes.in_features, sizes.hidden), nn.ReLU())
        width = sizes.hidden * 2
        self.projector = nn.Sequential(
            nn.Linear(sizes.hidden, width, bias=False), _randomized(nn.BatchNorm1d(width)), nn.ReLU(inplace=True),
            nn.Linear(width, width, bias=False), _randomized(nn.BatchNorm1d(width)), nn.ReLU(inplace=True),
            nn.Linear(width, sizes.out, bias=False))
        self.bn = _randomized(nn.BatchNorm1d(sizes.out, affine=False))
        for p in self.backbone.parameters():  # a frozen, pretrained backbone
            p.requires_grad = False
        self.projector[4].weight.requires_grad = False  # one batch norm's gamma frozen

    def forward(self, y1, y2):
        z1 = self.projector(self.backbone(y1))
        z2 = self.projector(self.backbone(y2))
        c = self.bn(z1).T @ self.bn(z2)
        c.div_(y1.shape[0])
        on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
        n = c.shape[0]
        off_diag = c.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten().pow_(2).sum()
        return on_diag + self.lambd * off_diag


class BarlowTwinsLike(nn.Module):
    compiled_parts = ("barlow",)
    zero_grads = ()

    def __init__(self, sizes: Sizes):
        super().__init__()
        self.sizes = sizes
        self.barlow = BarlowTwinsModule(sizes)

    def inputs(self, device) -> tuple:
        x = torch.randn(self.sizes.batch, self.sizes.in_features, device=device)
        return x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)

    def loss(self, run, y1, y2):
        return run("barlow")(y1, y2)

    def after_step(self) -> None:
        pass

    def evaluate(self, run, y1, y2):
        return run("barlow")(y1, y2)


# --------------------------------------------------------------------------- PointNet's classifier


class PointNetClassifier(nn.Module):
    def __init__(self, sizes: Sizes, classes: int = 10):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(sizes.in_features, sizes.hidden), _randomized(nn.BatchNorm1d(sizes.hidden))
        self.fc2, self.bn2 = nn.Linear(sizes.hidden, sizes.out), _randomized(nn.BatchNorm1d(sizes.out))
        self.dropout = nn.Dropout(p=0.4)
        self.fc3 = nn.Linear(sizes.out, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.fc1(x)))
        x = F.relu(self.bn2(self.dropout(self.fc2(x))))
        return F.log_softmax(self.fc3(x), dim=1)


class PointNetHead(nn.Module):
    """Trained with the dropout active (the chain ends before it: only fc1 -> bn1 -> relu fuses), then
    evaluated, where the dropout is an identity and fc2 -> dropout -> bn2 -> relu fuses too."""

    compiled_parts = ("classifier",)
    zero_grads = ("classifier.fc1.bias",)
    # Training runs dropout with p > 0: every copy must draw the same mask. Each is reseeded before its
    # step, and Inductor draws with eager's generator (fallback_random), not its own.
    random = True
    compile_options = {"fallback_random": True}

    def __init__(self, sizes: Sizes):
        super().__init__()
        self.sizes = sizes
        self.classifier = PointNetClassifier(sizes)

    def inputs(self, device) -> tuple:
        x = torch.randn(self.sizes.batch, self.sizes.in_features, device=device) * 2 + 0.5
        labels = torch.randint(0, 10, (self.sizes.batch,), device=device)
        return x, labels

    def loss(self, run, x, labels):
        return F.nll_loss(run("classifier")(x), labels)

    def after_step(self) -> None:
        pass

    def evaluate(self, run, x, labels):
        return run("classifier")(x)


SYSTEMS = {"dino": DinoLike, "moco_v3": MocoV3Like, "barlow_twins": BarlowTwinsLike, "pointnet": PointNetHead}


# --------------------------------------------------------------------------- the run


@dataclass
class Trajectory:
    """A quantity's values over the steps as one vector, kept as sums of squares: fusepass's and eager's
    squared distances to float64, and float64's squared size."""

    fused: float = 0.0
    eager: float = 0.0
    ref: float = 0.0
    steps: int = 0

    def add(self, what: str, fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> None:
        _check_comparable(what, fused, eager, ref)
        ref = ref.double()
        self.fused += (fused.double() - ref).square().sum().item()
        self.eager += (eager.double() - ref).square().sum().item()
        self.ref += ref.square().sum().item()
        self.steps += 1

    def errors(self) -> tuple[float, float]:
        """(fusepass's, eager's) relative error to float64 of the whole vector."""
        size = max(self.ref ** 0.5, 1e-300)
        return self.fused ** 0.5 / size, self.eager ** 0.5 / size


@dataclass
class TrainingRun:
    """A system three times: eager, with `compiled_parts` compiled by fusepass, and float64; each trained
    by SGD from the same start. Each copy is built from the same seed (weight-normed modules cannot be
    deep-copied). After every step: the loss, every gradient, every buffer and every parameter, by the
    float64 criterion; one-element values (the loss) over all steps as one vector, as Trio does.

    With `gradients_over_steps`, each gradient too is judged on all its steps' values as one vector (its
    Trajectory) rather than step by step: for runs long and wide enough that a relu's mask differs from
    float64's in a few elements now and then, where one step's gradient error is that flip's, not its
    rounding's (tests/test_real_models.py says where and what was measured)."""

    copies: dict
    optimizers: dict
    calls: dict
    zero_grads: tuple
    random: bool = False
    gradients_over_steps: bool = False
    scalars: dict = field(default_factory=dict)
    trajectories: dict = field(default_factory=dict)

    @classmethod
    def of(cls, system: Callable[[], nn.Module], device, options: Optional[dict] = None,
           gradients_over_steps: bool = False) -> "TrainingRun":
        copies = {}
        for name in ("eager", "fused", "ref"):
            torch.manual_seed(0)
            copies[name] = system().to(device)
        copies["ref"].double()
        calls = {name: {} for name in copies}
        options = {**getattr(copies["fused"], "compile_options", {}), **(options or {})}
        for part in copies["fused"].compiled_parts:
            calls["fused"][part] = torch.compile(getattr(copies["fused"], part), backend="fusepass", options=options)
        optimizers = {name: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
                      for name, m in copies.items()}
        return cls(copies, optimizers, calls, copies["eager"].zero_grads, getattr(copies["eager"], "random", False),
                   gradients_over_steps)

    def _run(self, name: str) -> Callable[[str], Callable]:
        return lambda part: self.calls[name][part] if part in self.calls[name] else getattr(self.copies[name], part)

    def _each(self, method: str, inputs: tuple, seed: int) -> dict:
        results = {}
        for name, model in self.copies.items():
            dtype = torch.float64 if name == "ref" else torch.float32
            args = tuple(_to(a, dtype) for a in self._inputs_of(name, inputs))
            if self.random:
                torch.manual_seed(seed)
            results[name] = getattr(model, method)(self._run(name), *args)
        return results

    def _inputs_of(self, name: str, inputs: tuple) -> tuple:
        """What copy `name` is fed of a step's inputs: the same for every copy (tools/equally_exact.py
        feeds one another row order)."""
        return inputs

    def train_step(self, step: int, device) -> None:
        for model in self.copies.values():
            model.train()
        inputs = self.copies["eager"].inputs(device)
        losses = self._each("loss", inputs, seed=1000 + step)
        for name, loss in losses.items():
            loss.backward()
        self._collect("loss", losses)
        self._compare_gradients()
        for name, model in self.copies.items():
            self.optimizers[name].step()
            self.optimizers[name].zero_grad(set_to_none=True)
            model.after_step()
        self._compare_state()

    @torch.no_grad()
    def eval_forward(self, device) -> None:
        for model in self.copies.values():
            model.eval()
        outputs = self._each("evaluate", self.copies["eager"].inputs(device), seed=0)
        self._compare("eval output", outputs)
        self._compare_state()

    def finish(self) -> None:
        for what, values in self.scalars.items():
            fused, eager, ref = (torch.tensor(v, dtype=torch.float64) for v in zip(*values))
            _check_errors(f"{what} (over {len(values)} steps)", *_errors(what, fused, eager, ref))
        for what, trajectory in self.trajectories.items():
            _check_errors(f"{what} (over {trajectory.steps} steps)", *trajectory.errors())

    def _collect(self, what: str, values: dict) -> None:
        self.scalars.setdefault(what, []).append(tuple(values[n].double().item() for n in ("fused", "eager", "ref")))

    def _compare(self, what: str, values: dict, over_steps: bool = False) -> None:
        fused, eager, ref = (values[n] for n in ("fused", "eager", "ref"))
        if zero_in_exact_arithmetic(eager, ref):
            _check_noise(what, fused, eager)
        elif fused.numel() == 1:
            self._collect(what, values)
        elif over_steps:
            self.trajectories.setdefault(what, Trajectory()).add(what, fused, eager, ref)
        else:
            _check_errors(what, *_errors(what, fused, eager, ref))

    def _named(self, kind: str) -> list[tuple[str, dict]]:
        tables = {name: dict(getattr(m, f"named_{kind}")()) for name, m in self.copies.items()}
        return [(key, {name: table[key] for name, table in tables.items()}) for key in tables["eager"]]

    def _compare_gradients(self) -> None:
        for key, params in self._named("parameters"):
            if params["ref"].grad is None:
                assert params["fused"].grad is None, f"{key}: a gradient where float64 has none"
                continue
            grads = {name: p.grad for name, p in params.items()}
            assert grads["fused"] is not None, f"no gradient for {key}"
            if key in self.zero_grads:
                _check_exactly_zero(f"grad {key}", grads["fused"], grads["eager"], grads["ref"])
            else:
                self._compare(f"grad {key}", grads, over_steps=self.gradients_over_steps)

    def _compare_state(self) -> None:
        for key, params in self._named("parameters"):
            self._compare(f"parameter {key}", {name: p.detach() for name, p in params.items()})
        for key, buffers in self._named("buffers"):
            if buffers["eager"].is_floating_point():
                self._compare(f"buffer {key}", buffers)
            else:
                assert torch.equal(buffers["fused"], buffers["eager"]), f"buffer {key}"


# A quantity whose float64 value is below this fraction of eager's is 0 in exact arithmetic (float64's
# rounding noise is that far below fp32's): eager's value is rounding noise, and "no further from float64
# than eager" would compare noise with noise. The gradient of a LayerNorm bias that feeds a linear and a
# batch norm in training is one. There fusepass's value must be noise of the same order: at most
# NOISE_SLACK times eager's.
EXACT_ZERO = 1e-6
NOISE_SLACK = 4.0


def zero_in_exact_arithmetic(eager: torch.Tensor, ref: torch.Tensor) -> bool:
    return ref.double().norm() <= EXACT_ZERO * eager.double().norm()


def _check_noise(what: str, fused: torch.Tensor, eager: torch.Tensor) -> None:
    size, eager_size = fused.double().norm().item(), eager.double().norm().item()
    assert size <= NOISE_SLACK * eager_size, (
        f"{what}: 0 in exact arithmetic; fusepass's rounding noise {size:.3g} is over {NOISE_SLACK:g}x eager's "
        f"{eager_size:.3g}")


def _to(value, dtype):
    if isinstance(value, list):
        return [_to(v, dtype) for v in value]
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value
