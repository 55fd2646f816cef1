"""What the GPU tools share: a problem file's model and inputs on the GPU, and one call of a provider
in a mode and precision (forward, or with --backward a training step), as fusepass-bench makes it."""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from fusepass.bench import load, precision_context, to_device


def add_arguments(parser: argparse.ArgumentParser, providers: list[str]) -> None:
    parser.add_argument("problem")
    parser.add_argument("--mode", choices=("train", "eval"), default="train")
    parser.add_argument("--precision", default="bf16-autocast")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--providers", nargs="+", default=providers)


def model_and_inputs(args: argparse.Namespace) -> tuple[torch.nn.Module, list]:
    """The problem's Model (seeded, on the GPU, in args.mode) and its inputs."""
    module = load(args.problem, 1)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).cuda().train(args.mode == "train")
    return model, to_device(module.get_inputs(), "cuda")


def one_call(model: Callable, inputs: list, args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    """model(*inputs) in args.precision, with grad in training (and a backward with --backward)."""
    grad = args.backward or args.mode == "train"

    def call() -> torch.Tensor:
        with precision_context(args.precision, "cuda"), torch.set_grad_enabled(grad):
            out = model(*inputs)
        if args.backward:
            out.float().sum().backward()
        return out

    return call
