"""The training configuration: one typed schema, loaded from TOML, written by the planner, read by the trainer.

Every section forbids unknown keys, so a typo is an error, not a silently ignored setting. Errors name the
key, the value and what is allowed (see `paratrain.config.load.format_validation_error`). The layout rules
the validators call live in paratrain.config.layout and paratrain.config.pipeline.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from paratrain.config.layout import check_parallel_config
from paratrain.config.names import (  # noqa: F401 - the names each field allows, re-exported
    DP_KINDS,
    MULTI_STAGE_SCHEDULES,
    PP_SCHEDULES,
    RECOMPUTE,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
)
from paratrain.config.ranks import DEFAULT_RANK_ORDER, MESH_DIMS  # noqa: F401 - MESH_DIMS re-exported
from paratrain.device import check_device_name
from paratrain.model.config import PRESETS, ModelConfig, load_model_config
from paratrain.stragglers import DEFAULT_THRESHOLD, DEFAULT_WINDOW


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelSection(Section):
    """Either a preset name, a model TOML file, or a Hugging Face folder; explicit fields override the shape."""

    preset: str = "tiny"
    hf_path: str | None = None  # a Hugging Face Llama folder (config.json + *.safetensors): weights are loaded
    layers: int | None = Field(default=None, gt=0)
    hidden: int | None = Field(default=None, gt=0)
    heads: int | None = Field(default=None, gt=0)
    kv_heads: int | None = Field(default=None, gt=0)
    ffn_hidden: int | None = Field(default=None, gt=0)
    vocab: int | None = Field(default=None, gt=0)
    max_seq: int | None = Field(default=None, gt=0)
    tie_embeddings: bool | None = None
    num_experts: int | None = Field(default=None, ge=0)
    experts_per_token: int | None = Field(default=None, gt=0)
    moe_ffn_hidden: int | None = Field(default=None, gt=0)
    shared_experts: int | None = Field(default=None, ge=0)
    first_dense_layers: int | None = Field(default=None, ge=0)
    router_score: Literal["softmax", "sigmoid"] | None = None
    capacity_factor: float | None = Field(default=None, gt=0)
    aux_loss_coef: float | None = Field(default=None, ge=0)

    def resolve(self) -> ModelConfig:
        if self.hf_path:
            from paratrain.model.hf_config import config_from_hf

            base = config_from_hf(self.hf_path)
        elif self.preset in PRESETS or Path(self.preset).is_file():
            base = load_model_config(self.preset)
        else:
            raise ValueError(f"model.preset='{self.preset}': allowed: {', '.join(PRESETS)} or a model TOML file")
        overrides = {k: v for k, v in self.model_dump(exclude={"preset", "hf_path"}).items() if v is not None}
        if self.hf_path and (fixed := sorted(set(overrides) - _NO_WEIGHT_FIELDS)):  # the weights fix these
            raise ValueError(f"model.{fixed[0]}={overrides[fixed[0]]!r} with model.hf_path='{self.hf_path}': the "
                             f"checkpoint's weights fix the shape; allowed with hf_path: "
                             f"{', '.join(sorted(_NO_WEIGHT_FIELDS))}")
        return ModelConfig(**{**base.model_dump(), **overrides}) if overrides else base


_NO_WEIGHT_FIELDS = {"max_seq", "capacity_factor", "aux_loss_coef"}  # overridable with hf_path: no weight has them


class MixSource(Section):
    """One source of a weighted mixture (data.mix); unset fields take the [data] values."""

    source: str
    weight: float = Field(default=1.0, gt=0)
    text_field: str | None = None
    messages_field: str | None = None
    split: str | None = None


class DataSection(Section):
    # "stdlib" = the embedded default: this Python's standard library source (on every machine with Python).
    source: str = "stdlib"
    mix: list[MixSource] | None = None
    prepared_dir: str = Field(default="", description="\"\" = data/<source name>-<hash of the data settings>: "
                              "another source, cap, tokenizer or vocabulary gets its own folder (set: shared, "
                              "prepared again whenever the settings change)")
    tokenizer: str = "auto"  # auto: model.hf_path's tokenizer.json, else train one; "train"; a file or folder
    vocab_size: int = Field(default=4096, ge=256, le=2**31 - 1)
    text_field: str = "text"
    messages_field: str = "messages"
    split: str = "train"
    max_source_bytes: int | None = Field(default=None, gt=0)
    val_fraction: float = Field(default=0.02, gt=0, lt=0.5)
    workers: int = Field(default=0, ge=0)
    shard_tokens: int = Field(default=2**27, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _default_prepared_dir(cls, data):
        """One folder per data setting unless one is named: a second config on a shared default folder prepared
        it again (another tokenizer, minutes of tokenization) each time the two took turns."""
        if isinstance(data, dict) and not data.get("prepared_dir"):
            return {**data, "prepared_dir": default_prepared_dir(data)}
        return data

    @model_validator(mode="after")
    def _check(self) -> DataSection:
        if self.mix is not None and not self.mix:
            raise ValueError("data.mix=[]: allowed: at least one {source, weight} entry, or no data.mix")
        if self.mix and self.source != "stdlib":  # the default stays in a dumped config beside a mix
            raise ValueError(f"data.source='{self.source}' and data.mix are both set; allowed: one of them")
        return self


_DATA_KEYS = ("source", "mix", "tokenizer", "vocab_size", "text_field", "messages_field", "split", "max_source_bytes",
              "val_fraction")  # what decides the tokens (shard_tokens and workers do not)


def default_prepared_dir(data: dict) -> str:
    """data/<name>-<6 hex digits>: the source's file or folder name (stdlib, mix) and a digest of the settings
    that decide the tokens, each as given or its default (so `data.vocab_size=4096` spelled out changes nothing)."""
    fields = DataSection.model_fields
    settings = {k: data.get(k, fields[k].default) for k in _DATA_KEYS}
    name = "mix" if settings["mix"] else Path(str(settings["source"]).rstrip("/")).stem or "data"
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:6]
    return f"data/{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{digest}"


# torch DDP's bucket_cap_mb: the one default of the DDP reducer, the stale-gradient runner and the planner
DEFAULT_DDP_BUCKET_MB = 25.0



class ParallelSection(Section):
    """Degrees of each mesh dimension. Ranks map onto them in rank_order (default tp innermost = the fastest
    links, then cp, then dp, pp outermost; paratrain.config.ranks).
    The planner's layout (paratrain.plan.Layout) is this section plus train.microbatch; the rules that relate the
    fields are in paratrain.config.rules (docs/architecture.md)."""

    dp: int = Field(default=-1, description="-1: whatever the world size leaves after tp*pp*cp")
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1, description="expert parallelism (MoE): the routed experts of each layer split "
                    "over ep ranks, borrowed from the dp x cp x tp ranks of a pipeline stage (paratrain.config.rules); "
                    "divides model.num_experts and dp*cp*tp/etp")
    etp: int = Field(default=1, ge=1, description="expert tensor parallelism (MoE): 1 (torchtitan's default: experts "
                     "keep their full width, ep also borrows tp ranks) or tp (experts TP-sharded like the dense MLP)")
    cp_attention: Literal["auto", "flash_cpu", "efficient", "math"] = Field(
        default="auto", description="cp block kernel: auto = the fused kernel (returns the log-sum-exp, no s x s "
        "scores) registered for the device; math = plain matmuls (reference)")
    sp: bool = False
    dp_kind: Literal[DP_KINDS] = "fsdp"
    dp_replicate: int = Field(default=1, ge=1, description="hsdp: replica groups (across nodes); shard within")
    rank_order: str = Field(default=DEFAULT_RANK_ORDER, description="how ranks map onto the mesh dimensions, "
                            "innermost first (Megatron-Core's `order`): tp-cp-dp-pp = consecutive ranks share a tp "
                            "group, pp outermost; tp-cp-pp-dp = Megatron's --use-tp-pp-dp-mapping and Llama 3's "
                            "[TP, CP, PP, DP], dp outermost. Allowed: tp first, then cp, dp, pp in any order")
    reshard_after_forward: bool | None = None  # fsdp/hsdp: True = zero_stage 3, False = 2; None: from zero_stage
    zero_stage: Literal[0, 1, 2, 3] | None = None  # DeepSpeed's numbering (paratrain.config.dp); None: from dp_kind
    recompute: Literal[RECOMPUTE] = "none"
    offload_layers: int = Field(default=0, ge=0, description="activations of the first N blocks of each pipeline "
                                "stage kept in host memory from their forward to their backward (Megatron-Core's "
                                "--cpu-offloading-num-layers; torch save_on_cpu); at most a stage's layers, not with "
                                "recompute='full'")
    vocab_parallel: Literal["auto", "off", "tp", "dp"] = Field(
        default="auto", description="where the embedding and output head are sharded by vocabulary rows: tp (Megatron's "
        "vocab-parallel embedding + cross entropy over the TP group, tied embeddings allowed), dp (the same over the "
        "FSDP/DDP ranks, outside FSDP: token ids and hidden states are gathered instead of the embedding), off "
        "(FSDP gathers them whole); auto = tp when tp > 1, else off")
    ddp_bucket_mb: float = Field(default=DEFAULT_DDP_BUCKET_MB, gt=0, description="ddp: gradient bucket size (MiB); smaller "
                                 "buckets start reducing earlier in backward")
    pp_schedule: Literal[PP_SCHEDULES] = "1f1b"
    virtual_stages: int = Field(default=1, ge=1)
    pp_layers: list[int] | None = None  # explicit layers per (virtual) stage; default balanced

    @model_validator(mode="before")
    @classmethod
    def _default_dp_kind(cls, data):
        """dp_kind unset: what zero_stage implies (0/1: ddp, replicated parameters; unset, 2, 3: fsdp)."""
        if isinstance(data, dict) and "dp_kind" not in data and data.get("zero_stage") in (0, 1):
            return {**data, "dp_kind": "ddp"}
        return data

    @model_validator(mode="after")
    def _check(self) -> ParallelSection:
        if self.dp_kind != "hsdp" and self.dp_replicate != 1:
            raise ValueError(f"parallel.dp_replicate={self.dp_replicate} is only allowed with dp_kind='hsdp'")
        if self.dp != -1 and self.dp < 1:
            raise ValueError(f"parallel.dp={self.dp}: allowed: -1 (infer) or >= 1")
        return self

    def non_dp_degree(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def ddp_bucket_bytes(self) -> int:
        """ddp_bucket_mb in bytes: the one conversion used by the DDP reducer, the stale runner and the planner."""
        return int(self.ddp_bucket_mb * 2**20)

class OptimSection(Section):
    lr: float = Field(default=3e-3, gt=0)
    min_lr: float = Field(default=3e-4, ge=0)
    warmup_steps: int = Field(default=20, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float = Field(default=1.0, ge=0, description="0 disables clipping")


class TrainSection(Section):
    steps: int = Field(default=200, gt=0)
    seq_len: int = Field(default=128, gt=1)
    global_batch: int = Field(default=16, gt=0, description="sequences per optimizer step, all DP ranks")
    microbatch: int = Field(default=4, gt=0, description="sequences per forward/backward on one DP rank")
    seed: int = 1234
    dtype: Literal["fp32", "bf16"] = "fp32"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    device: str = "auto"

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        return check_device_name(value, field=None)  # syntax here; availability when the run starts (paratrain.device)

    @model_validator(mode="after")
    def _check_precision(self) -> TrainSection:
        if self.reduce_dtype == "bf16" and self.dtype != "bf16":
            raise ValueError(f"train.reduce_dtype='bf16' needs train.dtype='bf16' (got dtype='{self.dtype}'); "
                             f"allowed with fp32 training: reduce_dtype='fp32'")
        return self
    eval_every: int = Field(default=50, ge=0, description="0 disables eval")
    eval_batches: int = Field(default=4, gt=0)
    log_every: int = Field(default=10, gt=0)
    deterministic: bool = True
    compile: bool = False
    progress: bool = True
    collective_timeout_s: float = Field(default=600.0, gt=0, description="timeout of the training collectives "
                                        "(a rank that stopped is an error after this)")
    watchdog_s: float = Field(default=120.0, ge=0, description="log which rank stopped when one has not moved "
                              "for this long while the others wait for it (0 = off)")


class CheckpointSection(Section):
    """Sharded DCP checkpoints, committed by a manifest written last; see docs/checkpoints.md."""

    dir: str = Field(default="", description="local path, shared filesystem path or s3://bucket/prefix; "
                                             "\"\" = <metrics.run_dir>/checkpoints")
    interval: int = Field(default=0, ge=0, description="steps between saves; 0 = only at the end")
    keep: int = Field(default=3, ge=1, description="complete checkpoints kept (older ones deleted)")
    async_save: bool = Field(default=False, description="write in a background thread while training continues")
    resume: str = Field(default="auto", description="\"auto\" = newest complete checkpoint in dir, \"none\", "
                                                    "or a checkpoint path")
    save_final: bool = Field(default=True, description="save after the last step")
    verify: Literal["checksum", "size", "none"] = Field(
        default="checksum", description="manifest check: sha256 of every file (at save and load), sizes only, or off")
    retries: int = Field(default=4, ge=1, description="attempts per storage operation (transient errors)")
    retry_base_s: float = Field(default=0.5, ge=0, description="first backoff wait; doubles per attempt, max 8 s")
    allow_fresh_start: bool = Field(default=False, description="start from step 0 although dir holds checkpoints "
                                    "that cannot be used (refused, no manifest); they are moved to dir/quarantine")
    partial_load: bool = Field(default=False, description="load a checkpoint of another model: the parameters "
                               "whose names and shapes match (others keep their init); default: refuse it")
    lease_ttl_s: float = Field(default=60.0, ge=0, description="run lease on dir: another run is refused while the "
                               "holder's heartbeat is younger than this; 0 = no lease")
    nonfinite: Literal["stop", "skip", "rollback"] = Field(
        default="stop", description="loss or grad norm NaN/inf since the last save, at a save: stop (exit 1, "
        "nothing written), skip the save and go on, or rollback to the newest checkpoint past the bad batches")
    max_rollbacks: int = Field(default=3, ge=0, description="nonfinite=\"rollback\": then stop")
    preempt_deadline_s: float = Field(default=90.0, gt=0, description="SIGTERM/SIGUSR1: save at the next step and "
                                      "exit 0; warn when that cannot finish this soon after the notice")
    collective_timeout_s: float = Field(default=1800.0, gt=0, description="timeout of the checkpoint's "
                                        "collectives (they wait for the slowest rank's write)")


class MetricsSection(Section):
    run_dir: str = "runs/default"
    jsonl: bool = True
    tensorboard: bool = True
    hardware: str = ""  # catalog entry whose peak FLOP/s defines MFU; "" = measured on this machine
    profile_every: int = Field(default=0, ge=0, description="profile one step in N for exposed communication "
                                                             "by kind (0 = never)")
    trace: bool = Field(default=True, description="with profile_every: write each profiled step as a Chrome "
                                                  "trace <run_dir>/traces/step_N.json (chrome://tracing, Perfetto)")
    wandb_project: str = Field(default="", description="also log to Weights & Biases (needs the wandb package)")
    mlflow_experiment: str = Field(default="", description="also log to MLflow (needs the mlflow package)")

    @field_validator("hardware")
    @classmethod
    def _check_hardware(cls, value: str) -> str:
        """The rule `train` applies (resolve_system), here, so `paratrain config` refuses what train would."""
        if value:
            from paratrain.hardware.catalog import resolve_system

            try:
                resolve_system(value)
            except ValueError as exc:
                raise ValueError(f"{exc}; allowed: a system of `paratrain hardware list` or a hardware TOML "
                                 f"file") from None
        return value


class StalenessSection(Section):
    """Straggler tolerance for data parallelism (policy names shared with the planner and simulator)."""

    policy: Literal["sync", "bounded_staleness", "time_budget"] = "sync"
    max_staleness: int = Field(default=0, ge=0)
    # Delay compensation for max_staleness > 0 (paratrain.parallel.stale_dp; docs/staleness.md): where step t's
    # gradient is computed. "optimizer_lookahead" = at the weights AdamW will reach when the gradient is applied,
    # predicted from this rank's own pending gradients; "weight_prediction" = w_t + s (w_t - w_{t-1}).
    compensation: Literal["none", "weight_prediction", "optimizer_lookahead"] = "optimizer_lookahead"
    # optimizer_lookahead only: replay pending steps whose all-reduce already completed with the reduced dp-mean
    # gradient instead of this rank's own (exact where it arrived; depends on arrival timing; docs/staleness.md).
    # None = automatic: on where supported (optimizer_lookahead, s > 0, no tensor parallelism), else off.
    lookahead_arrived: bool | None = None
    # lookahead_arrived only: before predicting, wait up to this fraction of the healthy ranks' step time for the
    # pending reductions to arrive (0 = never wait). A reduction held up by a straggler is not waited for beyond it.
    arrival_grace: float = Field(default=0.1, ge=0.0, le=1.0)
    step_budget_s: float = Field(default=0.0, ge=0)
    straggler_threshold: float = Field(default=DEFAULT_THRESHOLD, gt=1.0)  # the detector's (paratrain.stragglers)
    straggler_window: int = Field(default=DEFAULT_WINDOW, gt=0)
    evict_stragglers: bool = False
    # Test/benchmark only, inert when empty: slow a rank on purpose, e.g. "slowdown=2.0,rank=1" or
    # "sleep_s=0.05,probability=0.3,rank=-1,seed=0" (paratrain.stragglers.FaultInjection).
    test_fault_injection: str = ""

    @model_validator(mode="after")
    def _check(self) -> StalenessSection:
        from paratrain.stragglers import FaultInjection

        if self.policy == "sync" and self.max_staleness:
            raise ValueError(f"staleness.max_staleness={self.max_staleness} needs staleness.policy="
                             f"'bounded_staleness' or 'time_budget' (policy 'sync' has no stale gradients)")
        if self.policy == "sync" and self.test_fault_injection:
            raise ValueError("staleness.test_fault_injection is honoured by the stale-gradient runner only; for a "
                             "synchronous baseline use policy='bounded_staleness' with max_staleness=0")
        FaultInjection.parse(self.test_fault_injection)
        if self.lookahead_arrived and (self.compensation != "optimizer_lookahead" or self.max_staleness == 0):
            raise ValueError(f"staleness.lookahead_arrived=true needs staleness.compensation='optimizer_lookahead' "
                             f"and staleness.max_staleness > 0 (got compensation='{self.compensation}', "
                             f"max_staleness={self.max_staleness}); allowed: lookahead_arrived=false, or those")
        if self.lookahead_arrived is False and "arrival_grace" in self.model_fields_set and self.arrival_grace:
            raise ValueError(f"staleness.arrival_grace={self.arrival_grace} waits for reductions that "
                             f"staleness.lookahead_arrived replays; allowed: arrival_grace=0, or "
                             f"lookahead_arrived=true")
        return self


class TrainConfig(Section):
    # default_factory, not a default instance: pydantic deep-copies a default model instance for every config
    # that leaves its section out (a Python-level deepcopy, ~30% of a load_config); a fresh empty section is the
    # same value, validated in pydantic-core
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    staleness: StalenessSection = Field(default_factory=StalenessSection)

    @model_validator(mode="after")
    def _check_model(self) -> TrainConfig:
        cfg = self.model.resolve()  # raises a clear error for a bad preset/shape
        if self.train.seq_len > cfg.max_seq:
            raise ValueError(f"train.seq_len={self.train.seq_len} exceeds the model's max_seq={cfg.max_seq}")
        check_parallel_config(cfg, self.parallel, self.train.seq_len)  # tp vs heads/ffn/vocab, dp kinds, ...
        if self.staleness.policy != "sync" and cfg.num_experts:  # its step does not train the aux loss
            raise ValueError(f"staleness.policy='{self.staleness.policy}' with model.num_experts={cfg.num_experts}: "
                             f"mixture-of-experts models train synchronously only for now; allowed: 'sync'")
        if self.staleness.policy != "sync" and self.train.reduce_dtype != "fp32":
            raise ValueError(f"train.reduce_dtype='{self.train.reduce_dtype}' with staleness.policy="
                             f"'{self.staleness.policy}': the stale-gradient all-reduce runs in fp32; allowed: "
                             f"reduce_dtype='fp32'")
        return self

    def model_shape(self) -> ModelConfig:
        return self.model.resolve()


def precision_bytes(train: TrainSection) -> dict[str, int]:
    """Bytes per element that data parallelism moves for this [train] section (torch-free): parameters
    all-gathered by FSDP (param_bytes: 2 under bf16, whose MixedPrecisionPolicy gathers bf16 copies) and
    gradients reduced (grad_bytes: train.reduce_dtype). The planner's Options read the same keys
    (paratrain.plan.options.Options.param_bytes / grad_bytes), so a run's prediction uses the run's bytes."""
    size = {"fp32": 4, "bf16": 2}
    return {"param_bytes": size[train.dtype], "grad_bytes": size[train.reduce_dtype]}
