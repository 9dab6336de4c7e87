"""The pass manager: registry, records, logging, validation, lint + recompile."""
from __future__ import annotations

import logging

import pytest
import torch

from torchfuse.config import Config
from torchfuse.passes import DEFAULT_PIPELINE, REGISTRY, PassContext, PassRecord, run_passes

from _passes_helpers import check, inputs_of, trace

aten = torch.ops.aten


def _fn(x):
    a = (x * 2).sin()
    b = (x * 2).sin()  # duplicate for CSE
    dead = x.cos()  # noqa: F841  dead for DCE
    return a + b * 1


def test_registry_names_match_config_pipeline():
    assert set(REGISTRY) == {"dce", "cse", "constant_fold", "simplify", "merge_step_sums", "conv_bn_fold", "channels_last_convs",
                             "pad_mm", "unfuse_addmm", "unfuse_conv_bias", "strided_1x1_grads",
                             "accumulate_by_index_add"}
    assert DEFAULT_PIPELINE == Config().passes
    assert all(callable(p) for p in REGISTRY.values())


def test_records_and_changes():
    x = inputs_of(torch.float32, 4, 5)
    gm = trace(_fn, x)
    n0 = len(gm.graph.nodes)
    records = run_passes(gm, DEFAULT_PIPELINE, PassContext(inference=False))
    assert [r.name for r in records] == list(DEFAULT_PIPELINE)
    assert records[0].nodes_before == n0
    for prev, cur in zip(records, records[1:]):
        assert cur.nodes_before == prev.nodes_after
    assert all(r.seconds >= 0 for r in records)
    by_name = {r.name: r for r in records[:-1]}
    assert records[0].changes == 1 and records[0].nodes_after == n0 - 1  # the dead cos
    assert by_name["cse"].changes == 2  # mul and sin
    assert by_name["simplify"].changes == 1  # b * 1
    check(_fn, gm, [x])


def test_record_str_format():
    r = PassRecord("cse", 0.0004, 212, 180, 32)
    assert str(r) == "cse              0.4 ms  212 -> 180 nodes  (32 changes)"


def test_unknown_pass_raises_and_lists_valid_names():
    gm = trace(_fn, inputs_of(torch.float32, 3))
    before = str(gm.graph)
    with pytest.raises(ValueError) as e:
        run_passes(gm, ["dce", "no_such_pass"], PassContext(inference=False))
    for name in REGISTRY:
        assert name in str(e.value)
    assert str(gm.graph) == before  # nothing ran


def test_logs_each_record_at_debug(caplog):
    gm = trace(_fn, inputs_of(torch.float32, 3))
    with caplog.at_level(logging.DEBUG, logger="torchfuse.passes"):
        records = run_passes(gm, ["dce", "cse"], PassContext(inference=False))
    msgs = [r.getMessage() for r in caplog.records if r.name == "torchfuse.passes"]
    assert msgs == [str(r) for r in records]


def test_recompiles_generated_code():
    gm = trace(_fn, inputs_of(torch.float32, 3))
    assert "cos" in gm.code
    run_passes(gm, ["dce"], PassContext(inference=False))
    assert "cos" not in gm.code


def test_empty_pipeline_is_fine():
    gm = trace(_fn, inputs_of(torch.float32, 3))
    assert run_passes(gm, [], PassContext(inference=True)) == []


def test_graph_without_meta_is_left_alone():
    # a plain symbolic_trace graph: no aten targets, no meta["val"]; nothing may crash
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(x)) * 1 + torch.relu(x).sum()
    m = M().eval()
    gm = torch.fx.symbolic_trace(m)
    records = run_passes(gm, DEFAULT_PIPELINE, PassContext(inference=True))
    assert sum(r.changes for r in records) == 0
    x = inputs_of(torch.float32, 2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), m(x))
