"""Vocabulary-parallel embedding and head (parallel/vocab.py; TP's in parallel/tensor.py) against one device.

Parity (tests/parity.py: loss of the first forward, every gradient after the first backward, losses of 2 AdamW
steps; fp32, fixed seeds; tolerance as tests/test_parallel.py: loss rtol 1e-5 / atol 1e-6, gradient relative
L2 error 1e-5): TP2 with a tied embedding, and the vocabulary sharded over the FSDP2 / DDP ranks
(parallel.vocab_parallel="dp"), tied and untied, with gradient accumulation (2 microbatches per rank at dp 2).
Mechanism: under vocab_parallel="dp" no rank ever holds a (vocab, hidden) tensor, from construction through a
forward and backward; with it off, FSDP gathers exactly that (so the check can fail).
"""

import pytest
from parity import assert_cases_match, global_batch, make_config, parallel_run, reference
from test_materialize import RecordRealTensors

from paratrain.config import load_config
from paratrain.parallel import check_layout

LOSS_RTOL, LOSS_ATOL, GRAD_RTOL = 1e-5, 1e-6, 1e-5
SHAPE, STEPS = ["model.layers=2"], 2
TIED = ["model.tie_embeddings=true"]
MB4 = "train.microbatch=4"  # TP without dp: 2 microbatches of 4 rows (accumulation still runs), not 4 of 2
FSDP_DP = ['parallel.dp_kind="fsdp"', 'parallel.vocab_parallel="dp"']
CASES = {  # world size -> (untied cases, tied cases)
    2: ([["parallel.dp=2", *FSDP_DP], ["parallel.dp=2", 'parallel.dp_kind="ddp"', 'parallel.vocab_parallel="dp"']],
        [["parallel.tp=2", MB4], ["parallel.tp=2", "parallel.sp=true", MB4], ["parallel.dp=2", *FSDP_DP]]),
    4: ([["parallel.dp=4", *FSDP_DP]],
        [["parallel.tp=2", "parallel.dp=2", 'parallel.dp_kind="fsdp"'], ["parallel.dp=4", *FSDP_DP]]),
}


def _reference(case):
    """The single-device run of a case's model and microbatches (cached per session)."""
    return reference(make_config(SHAPE + [c for c in case if c.startswith(("model.", "train."))]), STEPS)


def _run(untied, tied):
    return [parallel_run(SHAPE + c, STEPS) for c in untied] + [parallel_run(SHAPE + TIED + c, STEPS) for c in tied]


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_single_device(dist_run, world):
    untied, tied = CASES[world]
    per_rank = dist_run(world, _run, untied, tied)
    for i, case in enumerate(untied + [TIED + c for c in tied]):
        assert_cases_match(_reference(case), [case], [[r[i]] for r in per_rank], LOSS_RTOL, LOSS_ATOL, GRAD_RTOL)


def _full_vocab_tensors(vocab_parallel: str) -> dict:
    """Build, forward and backward under the recorder; report every (vocab, hidden)-sized real tensor seen."""
    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    cfg = make_config(SHAPE + TIED + ["parallel.dp=4", 'parallel.dp_kind="fsdp"',
                                      f'parallel.vocab_parallel="{vocab_parallel}"'])
    shape = cfg.model_shape()
    recorder = RecordRealTensors()
    x, y = global_batch(cfg, 0)
    with recorder:
        runner = build_runner(cfg, init_distributed("cpu"))
        with runner.step_context():
            logits = runner.model(x[:2])
            runner.loss_fn(logits, y[:2]).backward()
    weight = runner.model.tok_embeddings.weight
    full = {(shape.vocab, shape.hidden), (shape.vocab * shape.hidden,)}
    return {"full": sorted(full & recorder.shapes), "local_weight": tuple(weight._local_tensor.shape),
            "tied": weight is runner.model.output.weight, "grad_local": tuple(weight.grad._local_tensor.shape),
            "logits_local": tuple(getattr(logits, "_local_tensor", logits).shape),
            "full_logits": sorted(s for s in recorder.shapes if len(s) >= 2 and s[-1] == shape.vocab)}


def test_no_rank_ever_holds_the_whole_embedding(dist_run):
    """vocab 256, hidden 128, dp 4: each rank holds a (64, 128) row shard of the tied matrix and its gradient,
    computes logits for the 4 ranks' 2 x 32 tokens on its 64 vocabulary entries, and no (256, 128) tensor ever
    exists on any rank. vocab_parallel=off gathers the (256, 128) matrix on every rank (the check can fail)."""
    for got in dist_run(4, _full_vocab_tensors, "dp"):
        assert got["full"] == [], got
        assert got["local_weight"] == (64, 128) and got["grad_local"] == (64, 128) and got["tied"], got
        assert got["logits_local"] == (8, 32, 64), got
        assert got["full_logits"] == [], got  # no (..., vocab) logits either
    for got in dist_run(4, _full_vocab_tensors, "off"):
        assert (256, 128) in got["full"], got


@pytest.mark.parametrize(("overrides", "world", "message"), [
    (["parallel.tp=2", 'parallel.vocab_parallel="dp"'], 2, r"vocab_parallel='dp' with parallel.tp=2"),
    (['parallel.vocab_parallel="tp"'], 2, r"vocab_parallel='tp' needs parallel.tp > 1"),
    (["parallel.pp=2", 'parallel.vocab_parallel="dp"'], 4, r"vocab_parallel='dp' with parallel.pp=2"),
    (['parallel.dp_kind="hsdp"', "parallel.dp_replicate=2", 'parallel.vocab_parallel="dp"'], 4,
     r"vocab_parallel='dp' with parallel.dp_kind='hsdp'"),
    (["model.vocab=250", 'parallel.vocab_parallel="dp"'], 4, r"data-parallel size 4 must divide model.vocab=250"),
    (['parallel.vocab_parallel="dp"', 'staleness.policy="bounded_staleness"'], 2, r"vocab_parallel='dp' with staleness"),
])
def test_bad_vocab_parallel_layouts_fail_before_building(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        check_layout(load_config(None, SHAPE + overrides), world)
