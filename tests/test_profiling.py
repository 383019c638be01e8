"""The per-step breakdown the planner is compared with: timers every step, the profiler on sampled steps for
forward vs backward and communication by kind, and the time a checkpoint save blocks the loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.config import load_config
from paratrain.train.data import prepare
from paratrain.train.loop import train

DATA = ["data.max_source_bytes=200000", "data.vocab_size=384"]


def settings(tmp: Path, run: str, *extra: str) -> list[str]:
    return ["model.vocab=384", "model.layers=2", "train.steps=4", "metrics.profile_every=2",
            "checkpoint.interval=3", "train.global_batch=8", "train.microbatch=2", "train.seq_len=32",
            "train.eval_every=0", "train.progress=false", "metrics.tensorboard=false", 'train.device="cpu"',
            f'metrics.run_dir="{tmp / run}"', f'data.prepared_dir="{tmp / "data"}"', *DATA, *extra]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiling")
    prepare(load_config(None, [f'data.prepared_dir="{tmp / "data"}"', *DATA]).data, log=lambda *_: None)
    return tmp


def _records(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update(rec)
    return out


def _train(sets: list[str]) -> dict:
    return train(load_config(None, sets))


def _check_breakdown(records: dict[int, dict], comm_kinds: set[str]) -> None:
    profiled, plain = records[2], records[1]
    assert "time_backward_s" not in plain and "time_backward_s" in records[4]
    fb = profiled["time_forward_backward_s"]
    assert 0 < profiled["time_backward_s"] < fb and profiled["time_forward_s"] > 0
    assert profiled["time_forward_s"] + profiled["time_backward_s"] == pytest.approx(fb)
    assert comm_kinds <= {k[len("comm_"):-2] for k in profiled if k.startswith("comm_")}, profiled
    assert records[3]["time_checkpoint_s"] > 0 and "time_checkpoint_s" not in records[2]


def test_single_process_breakdown(tmp):
    summary = _train(settings(tmp, "one"))
    _check_breakdown(_records(tmp / "one"), set())
    median = summary["breakdown_median_s"]
    assert {"forward_backward", "optimizer", "data"} <= median.keys()
    # over the profiled steps, not diluted: step 4's backward within step 4's forward+backward (the median of
    # forward_backward also holds the unprofiled step 3, which under load can be the shorter)
    assert 0 < median["backward"] < _records(tmp / "one")[4]["time_forward_backward_s"]
    # each profiled step (2 and 4) as a Chrome trace a user can open (chrome://tracing, Perfetto)
    traces = [tmp / "one" / "traces" / f"step_{n:08d}_rank0.json" for n in (2, 4)]
    assert summary["traces"] == [str(t) for t in traces]
    assert all(json.loads(t.read_text())["traceEvents"] for t in traces)
    # the headline throughput leaves out the warm-up steps (1, 2) and the profiled step 4: step 3 alone
    assert summary["tokens_per_s_note"] == "excludes 2 warm-up step(s) and 1 profiled step(s)"
    step3 = _records(tmp / "one")[3]
    assert summary["tokens_per_s"] == pytest.approx(step3["tokens_per_s"])


def test_ddp_breakdown_has_the_gradient_all_reduce_and_a_prediction_for_more_ranks_than_cores(dist_run, tmp):
    """DDP over 2 ranks: the profiled steps' breakdown holds the gradient all-reduce; and with a hardware file
    describing 1 core, the planner's prediction of the run shares it between the 2 ranks (sized_for), one node.
    One run checks both (a second DDP2 run cost ~2.7 CPU-s)."""
    got = dist_run(2, _train, settings(tmp, "ddp2", "parallel.dp=2", 'parallel.dp_kind="ddp"',
                                       f'metrics.hardware="{_hardware_file(tmp, cores=1)}"'))
    _check_breakdown(_records(tmp / "ddp2"), {"all_reduce"})
    assert got[0]["predicted"]["step_time_s"] > 0 and got[0]["predicted"]["breakdown_s"]["dp_comm"] > 0


def test_pipeline_breakdown_has_the_point_to_point_waits(dist_run, tmp):
    """Pipeline idle shows as time in point-to-point sends/receives and waits on the training thread."""
    dist_run(2, _train, settings(tmp, "pp2", "parallel.pp=2", 'parallel.pp_schedule="1f1b"'))
    records = _records(tmp / "pp2")
    kinds = {k for k in records[2] if k.startswith("comm_")}
    assert kinds & {"comm_p2p_s", "comm_wait_s"}, records[2]


def _hardware_file(tmp: Path, cores: int = 2) -> Path:
    from paratrain.calibrate.probe import ProbeResult, hardware_toml

    probe = ProbeResult(device="cpu", threads_per_rank=1, matmul_tflops_by_size={128: 0.02, 1024: 0.05},
                        memory_bw_gbytes_per_s=5.0, cores=cores,
                        link_fit={"latency_us": 100.0, "bw_gbytes_per_s": 1.0, "timeshare_step_us": 200.0})
    hw = tmp / f"local-{cores}.toml"
    hw.write_text(hardware_toml(probe, "local"))
    return hw


def test_run_prints_the_planners_prediction_beside_the_measurement(tmp, capsys):
    """plan -> train -> measure: with metrics.hardware naming a hardware file, the run's summary holds the
    planner's prediction for this very layout and software (eager kernels, DDP buckets), printed with the
    measured step time and breakdown."""
    from paratrain.train.summary import print_summary

    summary = _train(settings(tmp, "predicted", f'metrics.hardware="{_hardware_file(tmp)}"'))
    pred = summary["predicted"]
    assert pred["system"] == "local" and pred["step_time_s"] > 0 and pred["breakdown_s"]["compute"] > 0
    assert summary["planner_options"] == {"bucket_bytes": 25 * 2**20, "eager": True, "p2p_scatter_gather": False,
                                          "zero12_as_fsdp": True, "param_bytes": 4, "grad_bytes": 4}  # fp32
    print_summary(summary)
    out = capsys.readouterr().out
    assert "planner predicted" in out and "predicted     compute" in out and "measured      " in out


class _KernelEvent:
    """What torch's kineto results give per device kernel (name, device, start, duration)."""

    def __init__(self, name, start_us, dur_us, device="CUDA", index=0):
        from torch.autograd import DeviceType

        self._name, self._start, self._dur = name, int(start_us * 1000), int(dur_us * 1000)
        self._type, self._index = getattr(DeviceType, device), index

    def name(self):
        return self._name

    def start_ns(self):
        return self._start

    def duration_ns(self):
        return self._dur

    def device_type(self):
        return self._type

    def device_index(self):
        return self._index


def test_device_comm_is_the_collective_time_not_hidden_by_compute_on_the_same_device():
    """An all-reduce kernel of 100 us, 60 us of it under a compute kernel: 40 us exposed. Another device's compute
    does not hide it; host events are ignored (they are what the host-timed measure reads)."""
    from paratrain.train.profiling import device_comm_seconds

    events = [
        _KernelEvent("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 100),
        _KernelEvent("ampere_sgemm_128x64_nn", 40, 60),  # hides 40..100
        _KernelEvent("ampere_sgemm_128x64_nn", 50, 20),  # inside the previous one: not counted twice
        _KernelEvent("ncclDevKernel_AllGather_RING_LL", 200, 50),  # nothing runs beside it: all exposed
        _KernelEvent("ampere_sgemm_128x64_nn", 200, 50, index=1),  # another device's compute
        _KernelEvent("c10d::allreduce_", 0, 300, device="CPU"),  # host side: not this measure's business
    ]
    got = device_comm_seconds(events)
    assert got == pytest.approx({"all_reduce": 40e-6, "all_gather": 50e-6})
    assert device_comm_seconds([_KernelEvent("aten::mm", 0, 10, device="CPU")]) == {}


def test_breakdown_reads_the_training_thread_not_a_busier_background_thread():
    """An asynchronous checkpoint write running during a profiled step can keep its thread busier than the step;
    backward and communication still come from the thread that ran the autograd engine."""
    from types import SimpleNamespace

    from paratrain.train.profiling import backward_seconds, exposed_comm_seconds

    def event(thread, name, us):
        return SimpleNamespace(thread=thread, name=name, cpu_time_total=us, cpu_parent=None)

    events = [event(1, "autograd::engine::evaluate_function: MmBackward0", 300.0),
              event(1, "c10d::allreduce_", 100.0),
              event(2, "aten::copy_", 5000.0), event(2, "c10d::allgather_", 900.0)]  # the checkpoint thread
    assert backward_seconds(events) == pytest.approx(300e-6)
    assert exposed_comm_seconds(events) == pytest.approx({"all_reduce": 100e-6})
