"""fusepass.explain() and the debug dump of rewritten graphs."""

import copy
from pathlib import Path

import pytest
import torch

import fusepass
from tests.chains import ChainModel, SecondUser, Trio, TwoChains, assert_fused, make_input


def test_explain_reports_each_match_and_leaves_the_model_alone():
    model = ChainModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = fusepass.explain(model, make_input(8, 32))

    [match] = report.matches
    assert match["pattern"] == "linear_scale_batch_norm"
    assert len(match["nodes"]) == 3 and match["training"] is True
    assert match["shapes"] == {"x": (8, 32), "weight": (48, 32), "out": (8, 48)}
    assert match["dtypes"] == {"x": "float32", "linear": "float32", "out": "float32"}
    assert report.misses == [] and report.graph_breaks == []
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"explain() changed {key}"

    text = str(report)
    assert "1 rewrite(s), 0 miss(es)" in text and "linear_scale_batch_norm" in text and "(8, 32)" in text


def test_explain_counts_two_chains_and_lists_misses_with_reasons():
    assert len(fusepass.explain(TwoChains(), make_input(8, 32)).matches) == 2

    report = fusepass.explain(SecondUser("linear"), make_input(8, 32))
    # The chain is not fused; its linear, now bare, runs on fusepass's linear op.
    assert [m["pattern"] for m in report.matches] == ["linear"]
    [miss] = report.misses
    assert "other users" in miss["reason"]
    assert "Misses:" in str(report) and "other users" in str(report)


class PrintBetween(torch.nn.Module):
    """A print between the linear and the batch norm: Dynamo breaks the graph there."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = torch.nn.Linear(16, 24), torch.nn.BatchNorm1d(24)

    def forward(self, x):
        y = self.fc(x)
        print("between")
        return self.bn(y)


def test_explain_names_the_graph_break_that_split_a_chain(capsys):
    report = fusepass.explain(PrintBetween(), torch.randn(8, 16))
    assert [m["pattern"] for m in report.matches] == ["linear"] and report.graphs == 2
    [miss] = report.misses
    assert miss["node"] == "batch_norm" and "graph break" in miss["reason"]
    [graph_break] = report.graph_breaks
    assert graph_break["count"] == 1 and "`print`" in graph_break["reason"]
    assert "Graph breaks" in str(report) and "Hint" not in str(report)
    assert "between" in capsys.readouterr().out  # the model ran, print and all


class GroupedSoftmaxHead(torch.nn.Module):
    """BYOL's simplicial embedding: Linear -> BatchNorm1d, then a softmax over groups of features."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = torch.nn.Linear(16, 24), torch.nn.BatchNorm1d(24)

    def forward(self, x):
        return torch.softmax(self.bn(self.fc(x)).reshape(x.shape[0], 4, 6), dim=-1)


def test_a_reshape_ends_the_chain_before_the_softmax_and_is_reported():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    report = fusepass.explain(GroupedSoftmaxHead(), x)
    assert [m["pattern"] for m in report.matches] == ["linear_batch_norm"]
    [miss] = report.misses
    assert miss["node"] == "reshape" and "not a pointwise op" in miss["reason"]

    model = GroupedSoftmaxHead()
    compiled = torch.compile(copy.deepcopy(model), backend="fusepass")
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    assert_fused(rewrites=1, graphs=1)


def test_explain_shows_autocast_dtypes():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        [match] = fusepass.explain(ChainModel(), make_input(8, 32)).matches
    assert match["dtypes"] == {"x": "float32", "linear": "bfloat16", "out": "float32"}


def _check_dump(directory):
    before = sorted(directory.glob("graph_*_before.py"))
    after = sorted(directory.glob("graph_*_after.py"))
    reports = sorted(directory.glob("graph_*_report.txt"))
    assert len(before) == len(after) == len(reports) == 1
    assert "torch.nn.functional.batch_norm" in before[0].read_text()
    after_code = after[0].read_text()
    assert "torch.ops.fusepass.batch_norm_chain.default" in after_code
    assert "batch_norm(" not in after_code.replace("batch_norm_chain", "")
    assert "1 rewrite(s)" in reports[0].read_text()


def test_debug_dir_option_writes_graphs_and_report(tmp_path):
    torch.compile(ChainModel(), backend="fusepass", options={"debug_dir": str(tmp_path)})(make_input(8, 32))
    _check_dump(tmp_path)
    assert_fused(rewrites=1, graphs=1)


def test_debug_dir_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEPASS_DEBUG_DIR", str(tmp_path))
    torch.compile(ChainModel(), backend="fusepass")(make_input(8, 32))
    _check_dump(tmp_path)
    assert_fused(rewrites=1, graphs=1)


def test_unwritable_debug_dir_warns_once_and_still_fuses(tmp_path):
    """The dump is a by-product: a directory that cannot be made (here, under a regular file) gets one
    warning for all graphs, and every graph is still rewritten and runs fused."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    debug_dir = blocker / "dump"
    torch.manual_seed(18)
    trio = Trio.of(ChainModel(23, 17), options={"debug_dir": str(debug_dir)})
    with pytest.warns(UserWarning) as caught:
        for training in (True, False):
            trio.train(training)
            for batch in (12, 12):
                trio.step(make_input(batch, 23))
    trio.finish()
    dump_warnings = [w for w in caught if "debug dump" in str(w.message)]
    assert len(dump_warnings) == 1 and str(debug_dir) in str(dump_warnings[0].message)
    assert dump_warnings[0].category is UserWarning  # not a FusepassFallbackWarning: nothing fell back
    assert not debug_dir.exists() and blocker.read_text() == "not a directory\n"
    assert_fused(rewrites=2, graphs=2)


def test_the_dump_and_the_report_name_each_fused_ops_source_lines(tmp_path):
    """The nodes that replace a chain carry where it came from: the dump's rewritten graph prints the
    chain's last source line above the fused op (no node without one) and lists every line the fused op
    replaced; the report names the chain's last line."""
    torch.compile(ChainModel(), backend="fusepass", options={"debug_dir": str(tmp_path)})(make_input(8, 32))
    [after] = tmp_path.glob("graph_*_after.py")
    code = after.read_text()
    assert "No stacktrace found" not in code
    block = code.split("# fusepass: the source lines each fused op replaced\n", 1)[1]
    # the fused op alone: not its getitems, nor the foreach copy and counter increment that store the buffers
    assert [line.split(":")[0] for line in block.splitlines() if line.startswith("#   ")] == [
        "#   batch_norm_chain_default"]
    [listed] = [line for line in code.splitlines() if line.startswith("#   batch_norm_chain_default: ")]
    sources = listed.split(": ", 1)[1].split(", ")
    chains = str(Path(__file__).parent / "chains.py")
    # linear, the multiply (its innermost frame: inside ChainModel._mul), batch norm
    assert sources == [f"{chains}:{_line_of('y = self.linear(x)')}",
                       f"{chains}:{_line_of('return torch.mul(a, b) if self.torch_mul else a * b')}",
                       f"{chains}:{_line_of('y = self.bn(y)')}"]
    [match] = fusepass.explain(ChainModel(), make_input(8, 32)).matches
    assert match["source"] == f"{chains}:{_line_of('y = self.bn(y)')}"


def _line_of(text: str) -> int:
    source = (Path(__file__).parent / "chains.py").read_text().splitlines()
    return next(i + 1 for i, line in enumerate(source) if line.strip() == text)
