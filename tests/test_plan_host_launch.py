"""The host-issue floor of an eager training loop (Options.host_launch_s, plan.layer.host_issue_s): a layer pass whose
GPU kernels are shorter than the host needs to launch them takes the host's time; large layers are untouched."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from paratrain.model.config import gpt_config
from paratrain.plan.api import Layout, estimate
from paratrain.plan.layer import host_issue_s, layer_kernels
from paratrain.plan.options import Options

MEGATRON_2021 = Options(attention="unfused", grad_bytes=2, bucket_bytes=float("inf"), dp_overlap=0.0)


def _step(model, opts, tp=1, mb=1, gbs=32, recompute="full"):
    lay = Layout(tp=tp, pp=1, dp=-1, microbatch=mb, recompute=recompute, zero_stage=0)
    return estimate(model, "p4d.24xlarge", 1, model.max_seq, gbs, lay, opts)


def test_host_issue_counts_follow_the_kernels_and_the_recompute():
    model = gpt_config("gpt-small", 4, 256, 4, 51200, 512)
    opts = dataclasses.replace(MEGATRON_2021, host_launch_s=1e-5)
    k = layer_kernels(model, opts)
    assert k == 4 + 2 + 7  # qkv, proj, fc1, fc2; QK^T and AV; the unfused GPT block's elementwise kernels
    fwd, bwd = host_issue_s(model, opts, np.array(2.0), np.array(2))
    assert fwd == pytest.approx(1e-5 * (k + 2))
    assert bwd == pytest.approx(1e-5 * (2 * k + 2 + k + 2))  # backward + the full recompute's replayed forward
    _, bwd_none = host_issue_s(model, opts, np.array(2.0), np.array(0))
    assert bwd_none == pytest.approx(1e-5 * (2 * k + 2))


def test_small_layers_take_the_host_time_and_large_ones_do_not():
    small = gpt_config("gpt-small", 4, 256, 4, 51200, 512)
    base = _step(small, MEGATRON_2021, tp=2).step_time_s
    slow = [_step(small, dataclasses.replace(MEGATRON_2021, host_launch_s=h), tp=2).step_time_s for h in (1e-3, 2e-3)]
    assert slow[0] > 3 * base  # a millisecond per launch: far above this layer's GPU time
    waited = _step(small, dataclasses.replace(MEGATRON_2021, host_launch_s=1e-3), tp=2).time_breakdown_s["host_wait"]
    assert 0 < waited < slow[0] and waited == pytest.approx(slow[0] - base, rel=0.05)  # reported in the breakdown
    assert _step(small, MEGATRON_2021, tp=2).time_breakdown_s["host_wait"] == 0.0
    # host-bound: the layers' part grows by exactly what the host needs more (32 / (dp 4 x mb 1) = 8 microbatches x 4 layers)
    fwd, bwd = host_issue_s(small, dataclasses.replace(MEGATRON_2021, host_launch_s=1e-3), np.array(2.0), np.array(2))
    assert slow[1] - slow[0] == pytest.approx(8 * 4 * float(fwd + bwd), rel=1e-9)
    assert _step(small, dataclasses.replace(MEGATRON_2021, host_launch_s=1e-9), tp=2).step_time_s == base
    big = gpt_config("gpt-big", 2, 8192, 64, 51200, 2048)
    assert _step(big, dataclasses.replace(MEGATRON_2021, host_launch_s=60e-6), mb=4).step_time_s == \
        _step(big, MEGATRON_2021, mb=4).step_time_s


def test_host_launch_must_not_be_negative():
    with pytest.raises(ValueError, match="host_launch_s = -1"):
        Options(host_launch_s=-1.0)
