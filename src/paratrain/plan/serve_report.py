"""The text tables of `paratrain serve estimate | plan | recommend | simulate`."""

from __future__ import annotations


def print_estimates(ests, prompt: int, output: int) -> None:
    """One row per batch size."""
    print(f"{'batch':>6} {'TTFT ms':>8} {'ITL ms':>7} {'step ms':>8} {'req/s':>7} {'out tok/s':>10} {'KV GiB/dev':>10} fits")
    for e in ests:
        print(f"{e.batch:>6} {e.ttft_s * 1e3:>8.1f} {e.itl_s * 1e3:>7.2f} {e.decode_step_s * 1e3:>8.2f} "
              f"{e.requests_per_s:>7.2f} {e.output_tokens_per_s:>10,.0f} {e.kv_bytes_per_device / 2**30:>10.2f} "
              f"{'yes' if e.fits else 'NO'}")
    print(f"at most {ests[0].max_sequences} sequences of {prompt + output} tokens fit per replica")


def print_estimate(est) -> None:
    rep = est.replica
    gib = 2**30
    print(f"{est.model} on {est.system}: replica tp {rep.tp} x pp {rep.pp} ({est.devices} devices, {est.chips:g} chips), "
          f"weights {rep.weights}, KV {rep.kv}" + (f", speculative {rep.spec_tokens} x {rep.draft}" if rep.spec_tokens else ""))
    print(f"request          {est.prompt} in + {est.output} out tokens, batch {est.batch}")
    print(f"TTFT             {est.ttft_s * 1e3:.1f} ms (prefill {est.prefill_s * 1e3:.1f} ms + one decode step)")
    print(f"ITL              {est.itl_s * 1e3:.2f} ms (decode step {est.decode_step_s * 1e3:.2f} ms + prefill stalls)")
    print(f"throughput       {est.requests_per_s:.2f} req/s, {est.output_tokens_per_s:,.0f} output tok/s per replica")
    print(f"memory/device    weights {est.weights_bytes_per_device / gib:.2f} GiB + KV {est.kv_bytes_per_device / gib:.2f} GiB "
          f"of {est.memory_capacity_bytes / gib:.1f} GiB usable; at most {est.max_sequences} sequences "
          f"({'fits' if est.fits else 'DOES NOT FIT'})")
    print(f"KV per token     {est.kv_bytes_per_token_per_device / 1024:.1f} KiB per device")
    for note in est.notes:
        print(f"note: {note}")


def print_plan(model, system, target, plans, costs, check) -> None:
    print(f"{model.name} on {system.name}: {target.rate:g} req/s of {target.prompt}+{target.output} tokens, "
          f"TTFT <= {target.ttft_s or '-'} s, ITL <= {target.itl_s or '-'} s, planned at <= {target.max_utilization:.0%} load")
    experts = any(p.estimate.replica.ep > 1 for p in plans)  # a MoE plan's rows differ by ep too: show it
    print(f"{'#':>2} {'tp':>3} {'pp':>3} " + (f"{'ep':>3} " if experts else "")
          + f"{'w':>5} {'kv':>5} {'batch':>5} {'replicas':>8} {'chips':>7} {'nodes':>5} "
          f"{'TTFT ms':>8} {'ITL ms':>7} {'$/h':>9} {'$/M out':>8} {'$/M in':>7}")
    for i, (p, c) in enumerate(zip(plans, costs, strict=True), 1):
        e, r = p.estimate, p.estimate.replica
        usd = "-" if c.usd_per_hour is None else f"{c.usd_per_hour:,.0f}"
        out = "-" if c.usd_per_million_output_tokens is None else f"{c.usd_per_million_output_tokens:.3f}"
        inp = "-" if c.usd_per_million_input_tokens is None else f"{c.usd_per_million_input_tokens:.3f}"
        print(f"{i:>2} {r.tp:>3} {r.pp:>3} " + (f"{r.ep:>3} " if experts else "") + f"{r.weights:>5} {r.kv:>5} {e.batch:>5} {p.replicas:>8} {p.chips:>7g} "
              f"{c.nodes:>5} {e.ttft_s * 1e3:>8.0f} {e.itl_s * 1e3:>7.1f} {usd:>9} {out:>8} {inp:>7}")
    best = costs[0]
    print(f"chips per 1,000 req/s: {best.chips_per_1000_rps:,.0f}"
          + ("" if best.output_tokens_per_s_per_mw is None else
             f"; output tokens/s per MW of accelerators: {best.output_tokens_per_s_per_mw:,.0f}"))
    if check is not None:
        print(f"simulated (one replica at {target.rate / plans[0].replicas:.2f} req/s, {check.requests} requests): "
              f"TTFT p50 {check.ttft_s['p50'] * 1e3:.0f} ms p99 {check.ttft_s['p99'] * 1e3:.0f} ms; ITL p50 "
              f"{check.itl_s['p50'] * 1e3:.1f} ms p99 {check.itl_s['p99'] * 1e3:.1f} ms; TPOT mean "
              f"{check.tpot_s['mean'] * 1e3:.1f} ms; SLO met by {check.slo_attainment:.1%} of requests")
    if best.usd_per_hour is None:
        print(f"note: {best.price_source}; pass --price-per-node-hour-usd for costs")
    else:
        print(f"price: {best.price_source}")


def print_recommendation(workload: str, model: str, target, cands) -> None:
    from paratrain.cost.serving import WORKLOADS

    print(f"{workload}: {WORKLOADS[workload]['about']}; {target.rate:g} req/s of {model}")
    print(f"{'system':<18} {'chips':>6} {'$/h':>9} {'$/M out':>8} {'$/M in':>7} {'$/M tok':>8} {'chips/1k rps':>12}")
    for c in cands:
        if c.cost is None:
            print(f"{c.system:<18} {'-':>6}")
        else:
            k = c.cost
            f = (lambda v, d=3: "-" if v is None else f"{v:,.{d}f}")  # noqa: E731
            print(f"{c.system:<18} {k.chips:>6g} {f(k.usd_per_hour, 0):>9} {f(k.usd_per_million_output_tokens):>8} "
                  f"{f(k.usd_per_million_input_tokens):>7} {f(k.usd_per_million_tokens):>8} {k.chips_per_1000_rps:>12,.0f}")
        for reason in c.reasons:
            print(f"    {reason}")


def print_sweep(model, system, rep, requests, prompt, output, seconds: float, results) -> None:
    print(f"{model.name} on {system.name}, tp {rep.tp} pp {rep.pp}: {requests} requests of "
          f"{prompt}+{output} tokens per rate ({seconds:.2f} s)")
    print(f"{'rate':>7} {'thr rps':>8} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p99':>7} "
          f"{'TPOT':>7} {'batch':>6} {'goodput':>8}")
    for rate, r in results:
        print(f"{rate:>7.2f} {r.throughput_rps:>8.2f} {r.ttft_s['p50'] * 1e3:>8.0f}m {r.ttft_s['p90'] * 1e3:>7.0f}m "
              f"{r.ttft_s['p99'] * 1e3:>7.0f}m {r.itl_s['p50'] * 1e3:>7.1f}m {r.itl_s['p99'] * 1e3:>6.1f}m "
              f"{r.tpot_s['mean'] * 1e3:>6.1f}m {r.mean_batch:>6.1f} {r.goodput_rps:>8.2f}")
