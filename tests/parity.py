"""Parity harness: a parallel layout against the single-device reference, on the same global batch.

Every parallel feature is checked the same way: the loss after the first forward, every parameter's gradient
after one backward, and the losses of 3 optimizer steps, fp32, fixed seeds. Run `parallel_run` on every rank
(via the dist_run pool) and compare each rank's result with `reference` computed in one process.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from paratrain.config import TrainConfig, load_config
from paratrain.parallel.mesh import init_distributed
from paratrain.train.checkpoint import state_module
from paratrain.train.loop import build_optimizer, build_runner

WRAPPER_PREFIXES = ("module.", "_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def make_config(overrides: list[str] | None = None, **sections) -> TrainConfig:
    """A small fp32 config for parity tests: tiny-shaped model, deterministic, no data files needed."""
    base = ["model.preset=\"tiny\"", "model.layers=4", "model.vocab=256", "train.seq_len=32",
            "train.global_batch=8", "train.microbatch=2", "optim.warmup_steps=0", "optim.schedule=\"constant\"",
            "optim.lr=1e-3", "optim.grad_clip=1.0", "train.seed=7"]
    return load_config(None, base + list(overrides or []))


def global_batch(cfg: TrainConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    vocab = cfg.model_shape().vocab
    rows = torch.randint(0, vocab, (cfg.train.global_batch, cfg.train.seq_len + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_steps(cfg: TrainConfig, runner, steps: int = 3) -> dict:
    """Loss of the first forward, all gradients after the first backward, the losses of `steps` steps and the
    gradient norm before clipping of each step."""
    optimizer = build_optimizer(runner, cfg.optim)
    losses, grads, norms = [], {}, []
    per_rank = cfg.train.global_batch // runner.dp_size
    for step in range(steps):
        inputs, targets = global_batch(cfg, step)
        sl = slice(runner.dp_rank * per_rank, (runner.dp_rank + 1) * per_rank)
        loss = runner.forward_backward(inputs[sl], targets[sl])
        if step == 0:
            for name, p in state_module(runner.parts).named_parameters():
                if p.grad is not None:
                    grads[clean_name(name)] = full_tensor(p.grad).detach().clone()
        norms.append(float(runner.clip_grad_norm_(cfg.optim.grad_clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {"losses": losses, "grads": grads, "grad_norms": norms}


def reference(cfg: TrainConfig, steps: int = 3) -> dict:
    """The single-device run of the same config (parallel section ignored), computed once per test session for
    each distinct config: many layouts share one reference. Callers must not modify the result."""
    single = cfg.model_copy(update={"parallel": type(cfg.parallel)()})
    key = (single.model_dump_json(), steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_steps(single, build_runner(single, _single_env()), steps)
    return _REFERENCES[key]


_REFERENCES: dict[tuple[str, int], dict] = {}  # test-session cache of single-device runs (tests only)


def _single_env():
    from paratrain.parallel.mesh import DistEnv

    return DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def parallel_run(overrides: list[str], steps: int = 3) -> dict:
    """Run on every rank of the pool: the layout in `overrides`, same model and batches as the reference."""
    cfg = make_config(overrides)
    env = init_distributed("cpu")
    return run_steps(cfg, build_runner(cfg, env), steps)


def assert_matches_reference(ref: dict, got: dict, rtol: float = 1e-5, atol: float = 1e-6,
                             grad_rtol: float = 1e-5) -> None:
    """Losses within rtol/atol; each gradient present on this rank within grad_rtol of the reference, measured
    as ||g - g_ref|| / ||g_ref|| so that tiny entries do not dominate."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=atol)
    assert got["grads"], "no gradients collected"
    for name, g in got["grads"].items():
        assert name in ref["grads"], f"unexpected parameter {name}"
        r = ref["grads"][name]
        err = (g - r).norm() / r.norm().clamp_min(1e-12)
        assert err < grad_rtol, f"gradient of {name}: relative error {err:.2e}"


def assert_cases_match(ref: dict, cases: list[list[str]], per_rank_results: list[list[dict]], rtol: float = 1e-5,
                       atol: float = 1e-6, grad_rtol: float = 1e-5) -> None:
    """Every case on every rank against the reference; one failure message listing all mismatches."""
    failures = []
    for rank, results in enumerate(per_rank_results):
        for overrides, got in zip(cases, results, strict=True):
            try:
                assert_matches_reference(ref, got, rtol, atol, grad_rtol)
            except AssertionError as exc:
                failures.append(f"{' '.join(overrides)} (rank {rank}): {exc}")
    for i, overrides in enumerate(cases):  # every parameter's gradient is compared on some rank
        seen = set().union(*(results[i]["grads"] for results in per_rank_results))
        if missing := sorted(set(ref["grads"]) - seen):
            failures.append(f"{' '.join(overrides)}: no rank returned the gradient of {missing}")
    assert not failures, "\n".join(failures)
