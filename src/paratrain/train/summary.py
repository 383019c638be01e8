"""The run summary of `paratrain train`, as text: layout, loss, throughput, MFU, predicted vs measured step."""

from __future__ import annotations


def run_mfu(s: dict) -> float | None:
    """Model FLOPs utilisation of the whole run: train FLOPs per token x tokens/s over (ranks x peak)."""
    if not s.get("model_shape") or not s.get("peak_flops"):
        return None
    from paratrain.model.config import ModelConfig

    flops_per_token = ModelConfig(**s["model_shape"]).train_flops_per_token(s["seq_len"])
    return flops_per_token * s["tokens_per_s"] / (s["peak_flops"] * s["world_size"])


def print_summary(s: dict) -> None:
    if s.get("preempted"):
        p = s["preempted"]
        print(f"\npreempted ({p['signal']}) at step {p['step']}: checkpoint {p['checkpoint'] or 'NOT saved'}, "
              f"{p['seconds_after_notice']:.1f} s after the notice; start the same command again to resume")
    drop = (1 - s["last_loss"] / s["first_loss"]) if s["first_loss"] == s["first_loss"] else float("nan")
    print("\n=== paratrain run summary ===")
    print(f"layout          {s['layout']} on {s['world_size']} rank(s)")
    print(f"steps           {s['steps']} ({s['tokens']:,} tokens) in {s['wall_s']:.1f} s")
    print(f"loss            {s['first_loss']:.4f} -> {s['last_loss']:.4f} ({drop:.1%} lower)")
    print(f"throughput      {s['tokens_per_s']:,.0f} tokens/s ({s.get('tokens_per_s_note', 'all steps')})")
    if (mfu := run_mfu(s)) is not None:
        print(f"MFU             {mfu:.1%} (of the {s['peak_label']}: {s['peak_flops'] / 1e12:,.2f} TFLOP/s per rank)")
    print(f"metrics         {s['run_dir']}/metrics.jsonl, TensorBoard: {s['run_dir']}/tensorboard")
    print(f"checkpoint      {s['checkpoint'] or '(none saved)'}")
    if s.get("predicted"):
        pred, measured = s["predicted"], s.get("step_time_s_median", float("nan"))
        print(f"step time       measured {measured * 1e3:,.1f} ms (median), planner predicted "
              f"{pred['step_time_s'] * 1e3:,.1f} ms on {pred['system']} ({pred['step_time_s'] / measured - 1:+.0%})")
        shown = {k: v for k, v in pred["breakdown_s"].items() if v > 0}
        print("  predicted     " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in shown.items()))
        meas = s.get("breakdown_median_s", {})
        print("  measured      " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in meas.items()))
