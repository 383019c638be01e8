"""The configuration reference (`paratrain config --reference`, docs/config.md): every key, its type, default and
meaning, generated from the schema so it cannot drift."""

from __future__ import annotations

from paratrain.config.schema import TrainConfig

# Meaning of the keys whose Field has no description (shown by `paratrain config --reference`).
FIELD_HELP = {
    "model.preset": "preset name (tiny, small, llama2-7b/13b/70b, llama3-8b/70b, llama3.1-405b, llama3.2-3b; MoE: "
                    "tiny-moe, mixtral-8x7b, qwen3-30b-a3b, deepseek-v3) or a model TOML file",
    "model.hf_path": "a Hugging Face Llama folder (config.json + *.safetensors): shape and weights are loaded",
    "model.layers": "override: decoder blocks", "model.hidden": "override: model width",
    "model.heads": "override: attention heads", "model.kv_heads": "override: key/value heads (GQA)",
    "model.ffn_hidden": "override: SwiGLU inner width", "model.vocab": "override: vocabulary size (>= tokenizer's)",
    "model.max_seq": "override: longest sequence (RoPE table length)",
    "model.tie_embeddings": "override: share the embedding and output matrices",
    "model.num_experts": "override: routed experts per MoE layer (0 = dense; docs/moe.md)",
    "model.experts_per_token": "override: top-k experts per token", "model.moe_ffn_hidden": "override: expert width",
    "model.shared_experts": "override: always-on shared experts", "model.first_dense_layers": "override: dense "
    "first layers before the MoE layers", "model.router_score": "override: softmax (Mixtral, Qwen3) or sigmoid "
    "(DeepSeek-V3) router scores", "model.capacity_factor": "override: per-expert capacity c*T*k/E (unset: the "
    "preset's; presets are dropless)", "model.aux_loss_coef": "override: load-balancing loss coefficient",
    "data.source": "'stdlib' (this Python's standard library source, nothing downloaded), or a file or folder: "
                   "text, JSONL/JSON, Parquet, Arrow, a datasets save_to_disk folder, .npy tokens, Megatron .bin/.idx",
    "data.mix": "weighted mixture instead of data.source: [{source=..., weight=...}, ...] (as Megatron's blend)",
    "data.prepared_dir": "where the token shards, index, tokenizer.json and meta.json go",
    "data.tokenizer": "auto (model.hf_path's tokenizer.json, else train one), train (byte-level BPE trained on "
                      "the source), a tokenizer.json or a folder holding one",
    "data.vocab_size": "vocabulary of a trained tokenizer",
    "data.text_field": "JSONL/JSON/Parquet/Arrow/datasets records: the field holding the text",
    "data.messages_field": "records without the text field: the field holding chat messages (tokenizer's chat template)",
    "data.split": "split of a saved DatasetDict",
    "data.max_source_bytes": "explicit cap: read at most this many bytes of text (or token data) per source; "
                             "reported when it cuts; unset = all",
    "data.val_fraction": "share of each source's tokens held out for the eval loss",
    "data.workers": "tokenizer processes; 0 = auto (inline for a small corpus, else up to 8)",
    "data.shard_tokens": "tokens per output shard (a resumed prepare restarts at the last complete shard)",
    "parallel.tp": "tensor-parallel degree (innermost mesh dimension: fastest links)",
    "parallel.pp": "pipeline stages (outermost mesh dimension)",
    "parallel.cp": "context-parallel degree (ring attention; sequence split zig-zag)",
    "parallel.sp": "sequence parallelism inside the TP regions (needs tp > 1)",
    "parallel.dp_kind": "fsdp (FSDP2: sharded parameters), ddp (replicated, bucketed overlap), hsdp (replicate x "
                        "shard)",
    "parallel.reshard_after_forward": "fsdp/hsdp: false keeps parameters gathered between forward and backward "
                                      "(= zero_stage 2), true reshards them (= 3); unset: from zero_stage",
    "parallel.zero_stage": "DeepSpeed's ZeRO stage: 0 replicated (ddp), 1 + sharded optimizer state, 2 + sharded "
                           "gradients (fsdp/hsdp: reshard_after_forward=false), 3 + sharded parameters (fsdp/hsdp, the "
                           "default); unset: from dp_kind and reshard_after_forward. The runtime runs ddp 0 and "
                           "fsdp/hsdp 2-3; the planner models 1-2 on ddp too (docs/architecture.md)",
    "parallel.recompute": "activation recomputation: none, selective (attention core) or full (whole block)",
    "parallel.pp_schedule": "gpipe, 1f1b, interleaved_1f1b (virtual_stages > 1), zbv or dualpipev (V-shaped, 2 chunks per rank); the planner models each",
    "parallel.virtual_stages": "model chunks per pipeline rank",
    "parallel.pp_layers": "explicit layers per (virtual) stage, e.g. [6, 8, 8, 10]; default balanced",
    "optim.lr": "peak learning rate (AdamW)", "optim.min_lr": "learning rate at the end of the decay",
    "optim.warmup_steps": "linear warmup steps", "optim.schedule": "decay after warmup: cosine, linear or constant",
    "optim.weight_decay": "AdamW weight decay (matrices only)", "optim.beta1": "AdamW beta1",
    "optim.beta2": "AdamW beta2", "optim.eps": "AdamW epsilon",
    "train.steps": "optimizer steps", "train.seq_len": "tokens per sequence", "train.seed": "seed of weights and data order",
    "train.dtype": "fp32, or bf16 mixed precision: fp32 master weights and optimizer state, bf16 compute "
                   "(FSDP2 MixedPrecisionPolicy: bf16 gathers; autocast on the other paths); docs/devices.md",
    "train.reduce_dtype": "dtype of the data-parallel gradient reduction under bf16: fp32 (torchtitan's and "
                          "Megatron's default) or bf16 (half the traffic)",
    "train.device": "auto (the accelerator torch reports, else the host CPU), cpu, cuda, neuron "
                    "(Trainium, TorchNeuron) or any other torch.accelerator type",
    "train.eval_batches": "batches per eval", "train.log_every": "console line every N steps (without progress bar)",
    "train.deterministic": "torch deterministic algorithms", "train.compile": "torch.compile attention and MLP blocks",
    "train.progress": "progress bar on stderr when it is a terminal (in a log file: a line every log_every steps)",
    "metrics.run_dir": "metrics.jsonl, TensorBoard logs, config.toml and (default) checkpoints go here",
    "metrics.jsonl": "write metrics.jsonl", "metrics.tensorboard": "write TensorBoard logs",
    "metrics.hardware": "catalog system (or TOML file) whose peak defines MFU and whose planner prediction is "
                        "printed beside the measured step time; empty = measured peak",
    "staleness.policy": "sync, bounded_staleness (apply the gradient of step t-s) or time_budget",
    "staleness.max_staleness": "s: steps a gradient may lag (bounded_staleness)",
    "staleness.compensation": "s > 0: compute step t's gradient at predicted weights (optimizer_lookahead: "
                              "AdamW applied to this rank's pending gradients; weight_prediction: w_t + s(w_t - "
                              "w_{t-1})) or at w_t (none)",
    "staleness.lookahead_arrived": "optimizer_lookahead: replay pending steps whose all-reduce already arrived with the "
                                   "dp mean (exact there; timing-dependent, not bitwise reproducible); unset = on "
                                   "where supported (no tensor parallelism), false = the rank's own gradients "
                                   "(reproducible)",
    "staleness.arrival_grace": "lookahead_arrived: before predicting, wait up to this fraction of the healthy step "
                               "time for pending reductions (0 = never wait)",
    "staleness.step_budget_s": "time_budget: seconds per step each DP rank may spend on microbatches",
    "staleness.straggler_threshold": "flag a rank slower than this x the median step time",
    "staleness.straggler_window": "steps the straggler median is taken over",
    "staleness.evict_stragglers": "after the next checkpoint, exit with code 75 and write an eviction request",
    "staleness.test_fault_injection": "tests only: slow a rank on purpose (empty = off)",
}


def reference_markdown() -> str:
    """The configuration reference (docs/config.md is generated from this, so it cannot drift)."""
    lines = ["# Configuration reference", "",
             "Generated by `paratrain config --reference` from `src/paratrain/config/` (schema.py, reference.py). Every key can be set in "
             "the TOML file or with `--set section.key=value`.", ""]
    for section, field in TrainConfig.model_fields.items():
        cls = field.annotation
        doc = [(cls.__doc__ or "").strip(), ""] if cls.__doc__ else []
        lines += [f"## [{section}]", "", *doc, "| key | type | default | meaning |",
                  "|---|---|---|---|"]
        for name, f in cls.model_fields.items():
            kind = str(f.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "").replace(" | ", " or ")
            meaning = (f.description or FIELD_HELP.get(f"{section}.{name}", "")).replace("|", "/")
            lines.append(f"| `{name}` | `{kind}` | `{f.default!r}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)
