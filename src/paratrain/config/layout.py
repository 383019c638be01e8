"""Layout rules that need no process group (torch-free): run when the config is loaded, by the launcher before
any rank starts, and by the planner for every layout it estimates or writes. The rules themselves are written once, in
paratrain.config.rules (and the DP semantics in paratrain.config.dp); errors name the field, the value and what
is allowed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.config.dp import check_dp_fields, effective_dp, zero_stage_of  # noqa: F401 - effective_dp re-exported
from paratrain.config.rules import View, check, edp_degree

if TYPE_CHECKING:
    from paratrain.config.schema import ParallelSection
    from paratrain.model.config import ModelConfig


def resolve_degrees(pcfg: ParallelSection, world_size: int) -> dict[str, int]:
    """The size of each mesh dimension (torch-free, so launchers and the CLI can check a layout fast); dp=-1 takes what the others leave. Errors name the fields."""
    other = pcfg.non_dp_degree()
    dp = world_size // other if pcfg.dp == -1 else pcfg.dp
    if dp < 1 or dp * other != world_size:
        if pcfg.dp == -1:  # dp is inferred already: the other degrees must divide the world size
            raise ValueError(
                f"parallel: world size {world_size} is not a multiple of pp*cp*tp = {pcfg.pp}*{pcfg.cp}*{pcfg.tp} = "
                f"{other} (parallel.dp=-1 takes what they leave); allowed: pp*cp*tp dividing {world_size}, or "
                f"launch a multiple of {other} ranks")
        raise ValueError(
            f"parallel: world size {world_size} != pp*dp*cp*tp = {pcfg.pp}*{pcfg.dp}*{pcfg.cp}*{pcfg.tp}; "
            f"allowed: degrees whose product is the number of ranks (set parallel.dp=-1 to infer dp)")
    if pcfg.dp_kind == "hsdp" and dp % pcfg.dp_replicate:
        raise ValueError(f"parallel.dp_replicate={pcfg.dp_replicate} must divide the data-parallel size {dp} "
                         f"(hsdp: dp = dp_replicate x dp_shard)")
    # ep borrows dp, cp (and tp when etp = 1) ranks; with hsdp of one shard group
    check(view_of(None, pcfg, 0, dp=dp), groups=("ep_fold", "ep_hsdp"))
    return {"pp": pcfg.pp, "dp": dp, "cp": pcfg.cp, "tp": pcfg.tp}  # ep: a refold of dp x cp x tp (mesh.py)


def run_layout(pcfg: ParallelSection, degrees: dict[str, int], num_experts: int = 0) -> dict[str, int]:
    """The degrees a run reports (summary, checkpoint manifest, start-up banner): the mesh's pp/dp/cp/tp and, for
    a mixture-of-experts model, ep, etp and edp (each expert shard's data-parallel degree, config.rules'
    fold). A checkpoint's layout compares equal only under the same ep/etp too."""
    if not num_experts:
        return dict(degrees)
    edp = int(edp_degree(degrees["tp"], degrees["cp"], degrees["dp"], pcfg.ep, pcfg.etp))
    return {**degrees, "ep": pcfg.ep, "etp": pcfg.etp, "edp": edp}


def view_of(model_cfg: ModelConfig, pcfg: ParallelSection, seq_len: int, global_batch: int | None = None,
            microbatch: int = 1, dp: int | None = None) -> View:
    """The rules' view of one layout (dp=None: not known yet; pcfg.dp when given)."""
    return View(tp=pcfg.tp, pp=pcfg.pp, cp=pcfg.cp, sp=pcfg.sp, schedule=pcfg.pp_schedule,
                virtual_stages=pcfg.virtual_stages, dp_kind=pcfg.dp_kind, zero=zero_stage_of(pcfg), seq=seq_len,
                model=model_cfg, dp=dp if dp is not None else (pcfg.dp if pcfg.dp > 0 else None),
                microbatch=microbatch, global_batch=global_batch, ep=pcfg.ep, etp=pcfg.etp,
                dp_replicate=pcfg.dp_replicate, rank_order=pcfg.rank_order, offload=pcfg.offload_layers,
                recompute=pcfg.recompute)


def check_tp_layout(model_cfg: ModelConfig, tp: int, sp: bool, seq_len: int) -> None:
    """Raise one clear ValueError if the model cannot be split `tp` ways (the tp/sp rules of config.rules)."""
    check(View(tp=tp, pp=1, cp=1, sp=sp, schedule="1f1b", virtual_stages=1, dp_kind="ddp", zero=0, seq=seq_len,
               model=model_cfg), groups=("tp", "sp"))


def vocab_parallel_mode(pcfg: ParallelSection) -> str:
    """Where the vocabulary is sharded: "tp", "dp" or "off" (parallel.vocab_parallel with auto resolved)."""
    if pcfg.vocab_parallel == "auto":
        return "tp" if pcfg.tp > 1 else "off"
    return pcfg.vocab_parallel


def check_vocab_parallel(model_cfg: ModelConfig, pcfg: ParallelSection, dp: int | None = None) -> None:
    """One clear error for a vocab-parallel choice the runtime cannot run (dp: the resolved data-parallel size)."""
    mode, tp = vocab_parallel_mode(pcfg), pcfg.tp
    if tp > 1 and mode != "tp":
        raise ValueError(f"parallel.vocab_parallel='{pcfg.vocab_parallel}' with parallel.tp={tp}: tensor parallelism "
                         f"always shards the vocabulary over tp; allowed: auto or tp")
    if mode == "tp" and tp == 1:
        raise ValueError("parallel.vocab_parallel='tp' needs parallel.tp > 1; allowed with tp=1: auto, off or dp")
    if mode != "dp":
        return
    bad = [(k, v) for k, v in (("pp", pcfg.pp), ("cp", pcfg.cp)) if v > 1]
    if bad or pcfg.dp_kind == "hsdp":
        field, value = bad[0] if bad else ("dp_kind", "'hsdp'")
        raise ValueError(f"parallel.vocab_parallel='dp' with parallel.{field}={value}: the vocabulary is sharded "
                         f"over a 1-D fsdp/ddp group only (no pp, cp or hsdp yet); allowed: auto or off")
    if model_cfg.num_experts:
        raise ValueError(f"parallel.vocab_parallel='dp' with model.num_experts={model_cfg.num_experts}: not "
                         f"supported for mixture-of-experts models yet; allowed: auto or off")
    if dp is not None and model_cfg.vocab % dp:
        raise ValueError(f"parallel.vocab_parallel='dp': the data-parallel size {dp} must divide "
                         f"model.vocab={model_cfg.vocab}; allowed: off, or dp dividing the vocabulary")


def check_cp_layout(seq_len: int, cp: int, tp: int = 1, sp: bool = False, pp: int = 1) -> None:
    """One clear error for a layout context parallelism cannot run, before anything is built."""
    check(View(tp=tp, pp=pp, cp=cp, sp=sp, schedule="1f1b", virtual_stages=1, dp_kind="ddp", zero=0, seq=seq_len,
               model=None), groups=("cp",))


def check_parallel_config(model_cfg: ModelConfig, pcfg: ParallelSection, seq_len: int) -> None:
    """Every rule that needs the model shape but not the world size (the batch rules wait for dp)."""
    check_dp_fields(pcfg)
    check(view_of(model_cfg, pcfg, seq_len))
    check_vocab_parallel(model_cfg, pcfg)
    if pcfg.dp_kind == "hsdp" and pcfg.dp != -1 and pcfg.dp % pcfg.dp_replicate:
        raise ValueError(f"parallel.dp_replicate={pcfg.dp_replicate} must divide parallel.dp={pcfg.dp} "
                         f"(hsdp: dp = dp_replicate x dp_shard)")
