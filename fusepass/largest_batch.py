"""fusepass-bench's largest-batch mode: the largest batch whose training step (forward, backward and an
SGD step, in the problem's precision) fits in the GPU's memory, for each provider in a process of its
own (what one provider's process leaves cached would count against the next).

    fusepass-bench PROBLEM.py --largest-batch [--precision fp32 bf16-autocast]

The batch doubles from the problem's own until a step runs out of memory, then is bisected to within
RESOLUTION of the largest that trains. Every size is a new step shape: the first two compile (static,
then Dynamo's automatic dynamic shapes), the later ones reuse the symbolic graph.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from typing import Any, Callable, Optional

import torch
from tabulate import tabulate

from fusepass.providers import build_model, load, make_provider, problem_inputs, sync, training_step
from fusepass.warmup import with_batch

RESOLUTION = 1 / 32  # of the largest batch: the search stops when its bounds are this close
LIMIT = 1 << 22  # rows: a search that reaches it stops there (a CPU never runs out of memory)


def search(trains: Callable[[int], bool], start: int, limit: int = LIMIT) -> int:
    """The largest batch for which trains(batch) holds, taking every smaller batch to train too: 0 when
    not even one row does, `limit` when the search gets there."""
    good, bad = 0, None
    batch = max(1, start)
    while bad is None and good < limit:
        if trains(min(batch, limit)):
            good, batch = min(batch, limit), batch * 2
        else:
            bad = min(batch, limit)
    while bad is not None and bad - good > max(1, int(good * RESOLUTION)):
        middle = (good + bad) // 2
        if trains(middle):
            good = middle
        else:
            bad = middle
    return good


def run(path: str, provider: str, precision: str, device: str, size: Optional[list[int]] = None,
        shrink: int = 1, limit: int = LIMIT) -> dict[str, Any]:
    """In this process: the provider's largest trainable batch for the problem (at `size` / `shrink`)."""
    module = load(path, size, shrink)
    model = build_model(module, "train", device)
    example = problem_inputs(module, device)
    fn = make_provider(provider, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    tried: dict[int, bool] = {}

    def trains(batch: int) -> bool:
        inputs = [with_batch(value, batch) for value in example]
        try:
            training_step(fn, optimizer, inputs, precision, device)
            sync(device)
            tried[batch] = True
        except torch.OutOfMemoryError:
            tried[batch] = False
        finally:
            inputs = None  # the failed step's tensors go before the next try
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        return tried[batch]

    batch = example[0].shape[0] if example and isinstance(example[0], torch.Tensor) else 1
    largest = search(trains, batch, limit)
    return {"provider": provider, "precision": precision, "largest_batch": largest, "limit_reached": largest >= limit,
            "tried": {str(b): ok for b, ok in tried.items()}}


def compare(path: str, precision: str, providers: list[str], device: str, size: Optional[list[int]] = None,
            shrink: int = 1, limit: int = LIMIT) -> list[dict[str, Any]]:
    """Each provider in a process of its own; the results in that order."""
    problem = [path, ",".join(map(str, size)) if size else "-", str(shrink)]
    results = []
    for provider in providers:
        command = [sys.executable, "-m", "fusepass.largest_batch", *problem, provider, precision, device, str(limit)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{provider} failed:\n{done.stderr[-4000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    """The largest batch per provider, and each one's ratio to Inductor's where Inductor ran."""
    inductor = next((r["largest_batch"] for r in results if r["provider"] == "inductor"), None)
    rows = []
    for r in results:
        largest = f"{r['largest_batch']}" + (" (limit)" if r["limit_reached"] else "")
        ratio = f"{r['largest_batch'] / inductor:.2f}x" if inductor else "-"
        rows.append([r["provider"], r["precision"], largest, ratio, len(r["tried"])])
    return tabulate(rows, headers=["provider", "precision", "largest batch", "vs Inductor", "steps tried"])


def main(argv: Optional[list[str]] = None) -> int:
    """The child process: python -m fusepass.largest_batch PROBLEM SIZE SHRINK PROVIDER PRECISION DEVICE
    LIMIT (SIZE "N,K,F" or "-")."""
    path, size, shrink, provider, precision, device, limit = argv or sys.argv[1:]
    result = run(path, provider, precision, device, None if size == "-" else [int(s) for s in size.split(",")],
                 int(shrink), int(limit))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
