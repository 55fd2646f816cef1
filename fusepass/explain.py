"""What fusepass did to a model: the match report, `explain()`, and the debug dump."""

from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate
from torch._dynamo.utils import counters
from torch.fx import GraphModule

from fusepass import ddp, sync_batch_norm, timing
from fusepass.compile_context import mark_fusepass_backend
from fusepass.families import FAMILIES
from fusepass.lowering.schema import KernelOptions
from fusepass.matcher import Match, Miss, find_chains, source_line
from fusepass.model_state import state_restored

_dump_counter = itertools.count()


def describe_match(match: Match, graph_index: int) -> dict[str, Any]:
    """A match as explain() lists it: where, which member of its family, and what its family says of it."""
    return {"graph": graph_index, "pattern": match.pattern, "nodes": [n.name for n in match.nodes],
            "source": source_line(match.last), **match.family.describe(match), "verdict": match.verdict}


def describe_miss(miss: Miss, graph_index: int) -> dict[str, Any]:
    return {
        "graph": graph_index,
        "node": miss.node.name,
        "nodes": [n.name for n in miss.nodes],
        "reason": miss.reason,
    }


@dataclass
class Report:
    """The rewrites fusepass made (`matches`), the near-matches it left alone (`misses`), and where Dynamo
    broke the model into graphs (`graph_breaks`: a chain split by one never reaches fusepass whole)."""

    matches: list[dict[str, Any]] = field(default_factory=list)
    misses: list[dict[str, Any]] = field(default_factory=list)
    graphs: int = 0
    graph_breaks: list[dict[str, Any]] = field(default_factory=list)

    def add_graph(self, matches: list[Match], misses: list[Miss]) -> None:
        self.matches += [describe_match(m, self.graphs) for m in matches]
        self.misses += [describe_miss(m, self.graphs) for m in misses]
        self.graphs += 1

    def __str__(self) -> str:
        lines = [f"fusepass: {len(self.matches)} rewrite(s), {len(self.misses)} miss(es) "
                 f"in {self.graphs} graph(s)"]
        if self.matches:
            rows = [[m["graph"], m["pattern"], os.path.basename(m["source"]) or "-", " -> ".join(m["nodes"]),
                     f"{m['shapes']['x']} @ {m['shapes']['weight']} -> {m['shapes']['out']}",
                     f"{m['dtypes']['x']} / {m['dtypes']['linear']} / {m['dtypes']['out']}",
                     _mode(m["training"]), m["tail"], m["verdict"] or "-"] for m in self.matches]
            lines += ["", "Matches:", tabulate(rows, headers=["graph", "pattern", "source", "nodes", "x @ W -> out",
                                                              "dtypes x/linear/out", "mode", "tail",
                                                              "fused or Inductor's"],
                                               maxcolwidths=[None] * 7 + [40, 60])]
        if self.misses:
            rows = [[m["graph"], m["node"], m["reason"]] for m in self.misses]
            lines += ["", "Misses:", tabulate(rows, headers=["graph", "node", "reason"], maxcolwidths=[None, None, 80])]
        if self.graph_breaks:
            rows = [[b["count"], b["reason"]] for b in self.graph_breaks]
            lines += ["", "Graph breaks (Dynamo's; a chain split by one is not fused):",
                      tabulate(rows, headers=["count", "reason"], maxcolwidths=[None, 100])]
        return "\n".join(lines)


def _mode(training) -> str:
    return "-" if training is None else "train" if training else "eval"


def write_debug_dump(debug_dir: str, before: GraphModule, after: GraphModule, report: Report) -> str:
    """Writes graph_<k>_before.py, graph_<k>_after.py and graph_<k>_report.txt; returns the common prefix."""
    os.makedirs(debug_dir, exist_ok=True)
    prefix = os.path.join(debug_dir, f"graph_{os.getpid()}_{next(_dump_counter)}")
    for suffix, gm in (("before", before), ("after", after)):
        with open(f"{prefix}_{suffix}.py", "w") as f:
            f.write(gm.print_readable(print_output=False))
            f.write(_sources(gm))
    with open(f"{prefix}_report.txt", "w") as f:
        f.write(str(report) + "\n")
    return prefix


def _sources(gm: GraphModule) -> str:
    """A comment block naming, for each fused op (a call of an op in the fusepass namespace), every source
    line it replaced; the nodes around it (its outputs taken apart, the buffers' stores) carry the same."""
    lines = [f"#   {node.name}: {', '.join(node.meta['fusepass_sources'])}"
             for node in gm.graph.nodes if node.meta.get("fusepass_sources") and node.op == "call_function"
             and getattr(node.target, "namespace", None) == "fusepass"]
    return "\n# fusepass: the source lines each fused op replaced\n" + "\n".join(lines) + "\n" if lines else ""


def explain(model: torch.nn.Module, *example_inputs: Any, **example_kwargs: Any) -> Report:
    """What fusepass would rewrite in `model` for these inputs, without changing `model`.

    Runs the model once under torch.compile with a backend that only records the matches and misses of
    each graph Dynamo captures (the graphs run as they are). Whatever the forward changes is put back
    afterwards: every parameter's and buffer's value (batch norm's running statistics, an EMA on `.data`
    inside forward) and the random-number generators' states. The model is not copied: a weight-normed
    module refuses deepcopy. Each match's verdict (fused, or left to Inductor's faster code: timing.py) is
    the one cached from a compile with time_unfused=True, or why there is none (not timed, or not yet).
    The graph breaks are those Dynamo counted during that run (`counters["graph_break"]`), each by its
    title and explanation.
    """
    report = Report()

    @mark_fusepass_backend  # SyncBatchNorm captured, DDP's cuts kept out of chains, as fusepass's compiles
    def recording_backend(gm: GraphModule, _example_inputs):
        ddp.inline_chains(gm)  # a DDP piece's chains, held whole across the bucket cuts (ddp.py)
        matches, misses = find_chains(gm.graph, FAMILIES)
        for match in matches:
            match.verdict = timing.recorded(gm, match, KernelOptions())
        report.add_graph(matches, misses)
        return gm.forward

    ddp.install()
    sync_batch_norm.install()
    breaks_before = Counter(counters["graph_break"])
    with state_restored(model):
        torch.compile(model, backend=recording_backend)(*example_inputs, **example_kwargs)
    report.graph_breaks = [{"reason": _break_reason(reason), "count": count}
                           for reason, count in (counters["graph_break"] - breaks_before).items()]
    return report


def _break_reason(reason: str) -> str:
    """A graph break's title, and its explanation where Dynamo gives one (its hints and links left out)."""
    title, *rest = reason.strip().split("\n")
    explanation = next((line.strip().removeprefix("Explanation:").strip() for line in rest
                        if line.strip().startswith("Explanation:")), "")
    return f"{title.strip()}: {explanation}" if explanation else title.strip()
