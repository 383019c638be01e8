"""Cost, TCO and energy; recommendations; the HTML report."""

import json

import pytest

from paratrain.cli import main
from paratrain.cost.compare import (
    Assumptions,
    Workload,
    compare,
    nearby_global_batch,
    pareto_front,
    ratios_to_first,
)
from paratrain.cost.recommend import KINDS, Request, recommend
from paratrain.hardware.catalog import get_catalog

FAST = Assumptions(failures="daly")
GPU_AND_TRN = ["trn1.32xlarge", "p4d.24xlarge", "p5.48xlarge"]


def test_price_per_accelerator_and_per_pflop_come_from_the_catalog():
    rows = compare(Workload("llama2-7b", 1e11, 4096, 1024), [("trn1.32xlarge", 16), ("p4d.24xlarge", 16)], FAST)
    trn, p4d = rows
    cat = get_catalog()
    for row in rows:
        s = cat.system(row.system)
        assert row.purchase == "on-demand" and row.price_label == "on-demand, us-east-1, 2026-11-30"
        assert row.price_per_chip_hour_usd == pytest.approx(s.prices.on_demand_usd_per_hour / s.chips_per_node)
        peak_pf = s.chip.bf16_tflops * s.chips_per_node / 1e3
        assert row.price_per_peak_bf16_pflop_hour_usd == pytest.approx(s.prices.on_demand_usd_per_hour / peak_pf)
    # the source documents' figures: ~$21.50/h for 16 Trainium vs $21.96/h for 8 A100
    assert trn.price_per_chip_hour_usd / p4d.price_per_chip_hour_usd == pytest.approx((21.50 / 16) / (21.96 / 8), rel=0.01)
    (ratio,) = ratios_to_first(rows)
    assert ratio["first"] == "trn1.32xlarge x16" and ratio["other"] == "p4d.24xlarge x16"
    assert ratio["price_per_chip_hour_usd"] == pytest.approx(trn.price_per_chip_hour_usd / p4d.price_per_chip_hour_usd)
    assert ratio["cost_usd_per_million_tokens"] == pytest.approx(
        trn.cost_usd_per_million_tokens / p4d.cost_usd_per_million_tokens)
    # cost per token = price / throughput / goodput: the ratio follows from the planner, not from the prices alone
    expect = (21.50 / (trn.tokens_per_s * trn.goodput)) / (21.957642 / (p4d.tokens_per_s * p4d.goodput))
    assert ratio["cost_usd_per_million_tokens"] == pytest.approx(expect, rel=1e-6)


def test_cost_per_million_tokens_follows_from_throughput_goodput_and_price():
    wl = Workload("llama2-7b", 1e11, 4096, 1024)
    (row,) = compare(wl, [("p4d.24xlarge", 16)], FAST)
    tokens = wl.steps * wl.seq * wl.global_batch
    hours = tokens / row.tokens_per_s / 3600 / row.goodput
    assert row.wall_hours == pytest.approx(hours, rel=1e-6)
    assert row.cost_usd_per_million_tokens == pytest.approx(21.957642 * 16 * hours / tokens * 1e6, rel=1e-3)
    assert 0.9 < row.goodput < 1.0
    # energy: accelerators + host share, times PUE
    power = get_catalog().system("p4d.24xlarge").node_power_w * 1.25 * 16
    assert row.energy_mwh == pytest.approx(power * hours * 1.2 / 1e6, rel=1e-6)


def test_failures_make_runs_longer_and_more_expensive():
    wl = Workload("llama2-7b", 1e12, 4096, 1024)
    (none,) = compare(wl, [("p5.48xlarge", 64)], Assumptions(failures="none"))
    (daly,) = compare(wl, [("p5.48xlarge", 64)], FAST)
    assert none.goodput == 1.0 and daly.wall_hours > none.wall_hours
    assert daly.cost_usd > none.cost_usd


def test_pareto_front_keeps_only_undominated():
    rows = compare(Workload("llama2-7b", 1e11, 4096, 1024), [(s, 16) for s in GPU_AND_TRN], FAST)
    front = pareto_front(rows)
    for r in rows:
        if r not in front:
            assert any(f.wall_hours <= r.wall_hours and f.cost_usd <= r.cost_usd for f in front)


def _rec(kind, **kw):
    kw.setdefault("systems", GPU_AND_TRN)
    kw.setdefault("assumptions", FAST)
    return recommend(Request(kind=kind, **kw))


# At catalog prices among trn1 / p4d / p5 every kind lands on p5.48xlarge, for different reasons: a rule removes
# Trainium (research, multicloud, onprem) or the cost model ranks it last (pretrain, experiment, finetune).
# finetune's smaller job was a near tie (p4d $31.2k vs p5 $31.9k after h100p2p, 4 Dec 2026) that p4d won with
# offloaded activations; since hostlink (6 Dec 2026) p4d's A100s reach the host at 8 GB/s each when all copy (two
# GPUs per PCIe Gen3 x16 switch uplink, aws-ofi-nccl's p4d topology), so its best layout offloads nothing and costs
# $38.8k against p5's $32.1k. Which candidates survive the rules and what the reasons say is checked per kind.
EXPECTED = {
    "pretrain": ("p5.48xlarge", GPU_AND_TRN, "no hard constraint"),
    "finetune": ("p5.48xlarge", GPU_AND_TRN, "no hard constraint"),
    "research": ("p5.48xlarge", ["p4d.24xlarge", "p5.48xlarge"], "custom CUDA kernels"),
    "experiment": ("p5.48xlarge", GPU_AND_TRN, "no hard constraint"),
    "multicloud": ("p5.48xlarge", ["p4d.24xlarge", "p5.48xlarge"], "several clouds"),
    "onprem": ("p5.48xlarge", ["p4d.24xlarge", "p5.48xlarge"], "on-premises"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_gets_an_answer_with_reasons(kind):
    choice, survivors, rule = EXPECTED[kind]
    rec = _rec(kind)
    assert rec.choice == choice
    assert sorted(c["system"] for c in rec.candidates) == sorted(survivors)
    assert any(rule in r for r in rec.rules)
    # the first reason names the choice with its days and dollars; the ranking is by total cost
    assert rec.reasons[0].startswith(f"{choice} x ") and "$" in rec.reasons[0]
    totals = [c["total_usd"] for c in rec.candidates]
    assert totals == sorted(totals) and rec.candidates[0]["system"] == choice
    assert any("porting" in a for a in rec.assumptions)


def test_break_even_price_is_where_the_choice_flips():
    """The break-even price reported for a losing candidate is the price at which it ties the choice: 5%
    under it the candidate wins, 5% over it it still loses."""
    base = _rec("pretrain")
    trn = next(c for c in base.candidates if c["system"] == "trn1.32xlarge")
    even = trn["break_even_usd_per_node_hour"]
    assert 0 < even < get_catalog().system("trn1.32xlarge").prices.on_demand_usd_per_hour
    below = Assumptions(failures="daly", prices={"trn1.32xlarge": even * 0.95})
    above = Assumptions(failures="daly", prices={"trn1.32xlarge": even * 1.05})
    assert _rec("pretrain", assumptions=below).choice == "trn1.32xlarge"
    assert _rec("pretrain", assumptions=above).choice == base.choice


def test_unpriced_systems_get_a_break_even_price_not_a_rank():
    rec = _rec("pretrain", systems=["trn2.48xlarge", "p5.48xlarge"])
    assert rec.choice == "p5.48xlarge"
    trn2 = next(c for c in rec.candidates if c["system"] == "trn2.48xlarge")
    assert trn2["total_usd"] is None and trn2["break_even_usd_per_node_hour"] > 0
    assert any("trn2.48xlarge: no on-demand price published: " in r for r in rec.reasons)
    # a quote under the break-even makes it the answer
    quote = Assumptions(failures="daly", prices={"trn2.48xlarge": trn2["break_even_usd_per_node_hour"] * 0.9})
    assert _rec("pretrain", systems=["trn2.48xlarge", "p5.48xlarge"], assumptions=quote).choice == "trn2.48xlarge"


def test_clusters_have_the_same_chips_unless_nodes_are_given():
    rec = _rec("pretrain", chips=256)
    nodes = {c["system"]: c["nodes"] for c in rec.candidates}
    assert nodes == {"trn1.32xlarge": 16, "p4d.24xlarge": 32, "p5.48xlarge": 32}
    rec = _rec("pretrain", nodes=8)
    assert {c["nodes"] for c in rec.candidates} == {8}


def test_trn3_ultraserver_batch_is_kept_when_a_layout_admits_it():
    """4 Trn3 UltraServers = 2,304 logical cores (odd factor 9). nearby_global_batch finds the closest batch
    sharing that factor; it is used only when no layout admits the user's batch. Since the planner searches
    pipeline degrees that do not divide the layers (pp 9 for 80 layers), 1024 is admitted and kept."""
    assert nearby_global_batch(2304, 1024, 0.15) == 1152
    assert nearby_global_batch(2304, 1024, 0.10) == 1008  # 9 x 112: closer, fewer factors of two
    assert nearby_global_batch(2304, 1024, 0.01) == 1026  # 9 x 114
    assert nearby_global_batch(2304, 1024, 0.001) is None
    assert nearby_global_batch(4096, 1000, 0.15) is None  # a power-of-two cluster: nothing to fix this way
    rec = _rec("pretrain", systems=["trn3-ultraserver", "p5.48xlarge"])
    trn3 = next(c for c in rec.candidates if c["system"] == "trn3-ultraserver")
    assert trn3["nodes"] == 4 and trn3["global_batch"] == 1024
    assert trn3["layout"]["tp"] * trn3["layout"]["pp"] * trn3["layout"]["dp"] == 2304
    assert not any("instead of 1024" in r for r in rec.reasons)


def test_deadline_and_budget_exclude_candidates_and_say_so():
    base = _rec("pretrain")
    totals = {c["system"]: c["total_usd"] for c in base.candidates}
    days = {c["system"]: c["wall_days"] for c in base.candidates}
    # a deadline between p5's and the slower systems' days leaves p5 only
    rec = _rec("pretrain", max_days=days["p5.48xlarge"] * 1.01)
    assert [c["system"] for c in rec.candidates] == ["p5.48xlarge"] and any("deadline" in r for r in rec.rules)
    # a budget under the cheapest total leaves nothing, and the output says why
    rec = _rec("pretrain", max_usd=min(totals.values()) * 0.99)
    assert rec.choice is None and any("budget" in r for r in rec.rules)
    assert "no priced candidate" in rec.reasons[0]
    # an unpriced system's break-even is then the price that fits the budget
    rec = _rec("pretrain", systems=["trn2.48xlarge", "p5.48xlarge"], max_usd=1e6)
    trn2 = rec.candidates[0]
    assert rec.choice is None and trn2["system"] == "trn2.48xlarge"
    hours = trn2["wall_days"] * 24
    assert trn2["break_even_usd_per_node_hour"] == pytest.approx((1e6 - trn2["porting_usd"]) / (trn2["nodes"] * hours))


def test_constraints_apply_to_any_kind():
    rec = _rec("pretrain", constraints=["multicloud"], assumptions=Assumptions(failures="daly",
                                                                               prices={"trn1.32xlarge": 4.0}))
    assert rec.choice != "trn1.32xlarge"  # cheap, but a multi-cloud pre-training run cannot use it
    assert all(c["system"] != "trn1.32xlarge" for c in rec.candidates)
    assert any("several clouds" in r for r in rec.rules)
    # the research kind implies the CUDA-kernel rule; naming it again does not repeat it
    assert len(_rec("research", constraints=["cuda-kernels"]).rules) == 1


def test_bad_request_values_are_refused():
    for kw, field_name in (({"nodes": 0}, "nodes = 0"), ({"chips": -1}, "chips = -1"),
                           ({"train_tokens": -5.0}, "train_tokens = -5.0"), ({"max_days": 0}, "max_days = 0"), ({"max_usd": -1.0}, "max_usd = -1.0"),
                           ({"systems": ["trn9"]}, "hardware 'trn9': unknown system"),
                           ({"constraints": ["tpu"]}, "constraints = \\['tpu'\\]: allowed: cuda-kernels")):
        with pytest.raises(ValueError, match=field_name):
            Request(kind="pretrain", **kw)


def test_price_that_matters_changes_the_recommendation():
    cheap_trn = Assumptions(failures="daly", prices={"trn1.32xlarge": 4.0})
    base = _rec("pretrain")
    assert base.choice != "trn1.32xlarge"  # at catalog prices the planner finds GPUs cheaper per token
    assert _rec("pretrain", assumptions=cheap_trn).choice == "trn1.32xlarge"
    # a short experiment does not pay back porting the code, however cheap the hardware
    assert _rec("experiment", assumptions=cheap_trn).choice != "trn1.32xlarge"
    # ... unless the team already runs on Neuron
    assert _rec("experiment", assumptions=cheap_trn, current_stack="neuron").choice == "trn1.32xlarge"
    # custom CUDA kernels: a rule, not a price
    assert _rec("research", assumptions=cheap_trn).choice != "trn1.32xlarge"


def test_compare_takes_steps_or_tokens(capsys):
    base = ["compare", "--model", "llama2-7b", "--targets", "p4d.24xlarge:16", "--failures", "none", "--json"]
    assert main([*base, "--steps", "500"]) == 0
    by_steps = json.loads(capsys.readouterr().out)
    assert main([*base, "--train-tokens", str(500 * 4096 * 1024)]) == 0
    by_tokens = json.loads(capsys.readouterr().out)
    assert by_steps["workload"]["steps"] == by_tokens["workload"]["steps"] == 500
    assert by_steps["rows"][0]["wall_hours"] == pytest.approx(by_tokens["rows"][0]["wall_hours"])
    with pytest.raises(SystemExit):  # one or the other (argparse)
        main([*base, "--steps", "500", "--train-tokens", "1e9"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main([*base, "--steps", "0"]) == 2
    assert "--steps = 0: must be >= 1" in capsys.readouterr().err


def test_compare_table_shows_price_option_region_and_date_beside_costs(capsys):
    assert main(["compare", "--model", "llama2-7b", "--train-tokens", "1e11", "--targets", "trn1.32xlarge:16",
                 "--failures", "daly"]) == 0
    out = capsys.readouterr().out
    for column in ("accel-h", "cost $", "overhead", "$/Mtok", "MWh", "Mtok/MWh", "price (option, region, date)"):
        assert column in out, column
    (row,) = compare(Workload("llama2-7b", 1e11, 4096, 1024), [("trn1.32xlarge", 16)], FAST)
    assert f"{row.accelerator_hours:,.0f}" in out and f"{row.cost_usd:,.0f}" in out
    assert "$21.50/node-h (on-demand, us-east-1, 2026-11-30)" in out
    # the sensitivity: every option the catalog prices trn1 at, each with its region and date
    assert "sensitivity 1: $ per million tokens by purchase option" in out
    for option, where in (("capacity-block", "ap-southeast-4, 2024-12"), ("savings-3y", "us-east-1, 2026-11-30"),
                          ("spot", "us-east-1, 2026-11-30")):
        usd = row.cost_by_purchase_usd[option] / row.tokens * 1e6
        assert f"{usd:.3f} ({where})" in out, option
    assert "sensitivity 2: rank at on-demand with only its own price scaled" in out
    # Trainium1's power is a placeholder (no public TDP): the energy figure says so
    assert "energy uses 275 W per trainium1: estimate" in out


def test_bad_kind_and_price_are_refused(capsys):
    with pytest.raises(ValueError, match="kind='train'"):
        Request(kind="train")
    assert main(["recommend", "pretrain", "--price-per-node-hour-usd", "trn1.32xlarge=cheap"]) == 2
    assert "--price-per-node-hour-usd 'trn1.32xlarge=cheap': expected SYSTEM=USD" in capsys.readouterr().err
    assert main(["recommend", "pretrain", "--price-per-node-hour-usd", "trn1.32xlarge=-3"]) == 2
    assert "must be a number > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="purchase = 'lease': allowed: on-demand, capacity-block"):
        Assumptions(purchase="lease")


def test_the_old_ambiguous_price_flag_is_refused_in_both_commands(capsys):
    """--price meant USD per node-hour in compare and per device-hour in simulate: both refuse it now and name
    the flag with the unit."""
    assert main(["compare", "--model", "llama2-7b", "--train-tokens", "1e9", "--targets", "p5.48xlarge:1",
                 "--price", "p5.48xlarge=40"]) == 2
    assert "use --price-per-node-hour-usd SYSTEM=USD" in capsys.readouterr().err
    assert main(["simulate", "--devices", "64", "--step-time", "1s", "--steps", "10", "--price", "2.5"]) == 2
    assert "use --price-per-device-hour-usd USD" in capsys.readouterr().err


def test_report_renders_with_non_empty_pngs(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["compare", "--model", "llama2-7b", "--train-tokens", "1e11", "--targets",
                 "trn1.32xlarge:16,p4d.24xlarge:16", "--failures", "daly", "--report", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == 2
    page = (out / "index.html").read_text()
    import re

    images = re.findall(r'<img src="([^"]+)"', page)
    assert len(images) == 5 and "sensitivity.png" in images
    assert "Pareto front (no other cluster" in page and "p4d.24xlarge x" in page
    assert "trn1.32xlarge x16 / p4d.24xlarge x16: $/node-hour 0.98, $/chip-hour 0.49" in page
    assert "accelerator-hours" in page and "(on-demand, us-east-1, 2026-11-30)" in page
    assert "sensitivity 2: rank at on-demand" in page
    for name in images:
        blob = (out / name).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 5000


def test_every_system_has_a_dated_price_or_a_break_even_in_its_place():
    """Walk the catalog: every system has at least one published price (purchase option, region, source, a real
    date), or says "no public price" with why; for those, compare reports the break-even price per node-hour at
    which it would tie a priced alternative, and it is exactly the price that gives the same cost per token."""
    import re

    from paratrain.hardware.catalog import NO_PRICE_TABLE, PURCHASE_OPTIONS

    unpriced = []
    for system in get_catalog().systems.values():
        prices = system.prices
        if not prices.quotes:  # an explicit reason in a [prices.X] table, not the loader's default
            assert prices.no_public_price.strip() and prices.no_public_price != NO_PRICE_TABLE, (
                f"{system.name}: add a [prices.{system.name}] table to hardware/catalog/prices.toml: a quote per purchase "
                "option (usd_per_node_hour, region, source, date) or no_public_price = 'why'")
            unpriced.append(system.name)
            continue
        for option, quote in prices.quotes.items():
            assert option in PURCHASE_OPTIONS and quote.purchase == option
            assert quote.usd_per_node_hour > 0 and quote.source.strip() and quote.region.strip(), system.name
            assert re.fullmatch(r"\d{4}-\d{2}(-\d{2})?", quote.date), (system.name, option, quote.date)
    assert {"trn2-ultraserver", "trn3-ultraserver"} <= set(unpriced)
    wl = Workload("llama3-8b", 1e9, 2048, 1152)
    rows = compare(wl, [("p5.48xlarge", 1)] + [(name, 1) for name in unpriced], Assumptions(failures="none"))
    best = rows[0]
    for row in rows[1:]:
        assert row.cost_usd is None and row.price_label == "no public price"
        even = row.break_even_usd_per_node_hour
        assert even is not None and 0 < even < float("inf"), row.system
        assert even * row.nodes * row.wall_hours / row.tokens * 1e6 == pytest.approx(
            best.cost_usd_per_million_tokens, rel=1e-9)


def test_purchase_option_picks_the_catalog_price_and_says_which():
    wl = Workload("llama2-7b", 1e10, 4096, 1024)
    (cb,) = compare(wl, [("p5.48xlarge", 4)], Assumptions(failures="none", purchase="capacity-block"))
    (od,) = compare(wl, [("p5.48xlarge", 4)], Assumptions(failures="none"))
    assert cb.price_usd_per_node_hour == 39.33 and cb.price_label == "capacity-block, us-east-1, 2024-12"
    assert cb.cost_usd == pytest.approx(39.33 * 4 * cb.wall_hours)
    assert cb.wall_hours == od.wall_hours  # the price does not change the plan
    assert od.cost_by_purchase_usd["capacity-block"] == pytest.approx(cb.cost_usd)
    assert od.cost_by_purchase_usd["savings-1y"] is None and od.price_label_by_purchase["savings-1y"] is None
    # an option a system has no price for: no stand-in from another option, a break-even instead
    rows = compare(wl, [("trn1.32xlarge", 8), ("p5.48xlarge", 4)], Assumptions(failures="none", purchase="savings-3y"))
    trn, p5 = rows
    assert trn.price_usd_per_node_hour == 8.20 and p5.cost_usd is None
    assert p5.price_label == "no savings-3y price published"
    assert p5.break_even_usd_per_node_hour == pytest.approx(
        trn.cost_usd_per_million_tokens * p5.tokens / 1e6 / (p5.nodes * p5.wall_hours))
    # a user price wins at every option
    (given,) = compare(wl, [("p5.48xlarge", 4)], Assumptions(failures="none", purchase="spot",
                                                             prices={"p5.48xlarge": 30.0}))
    assert given.price_usd_per_node_hour == 30.0 and given.price_label == "given by the user"


def test_sensitivity_ranks_by_option_and_by_own_price():
    from paratrain.cost.sensitivity import Item, by_purchase, price_range

    a = Item("a", 1e6, {"on-demand": 10.0, "spot": 2.0}, {"on-demand": "r, 2026-01", "spot": "r, 2026-01"})
    b = Item("b", 1e6, {"on-demand": 8.0, "spot": None})
    c = Item("c", 1e6, {"on-demand": 12.0, "spot": 3.0}, extra_usd=0.5)
    table = {r["purchase"]: r for r in by_purchase([a, b, c])}
    assert table["on-demand"]["ranking"] == ["b", "a", "c"]  # $/Mtok: 8, 10, 12.5
    assert table["spot"]["ranking"] == ["a", "c"] and table["spot"]["usd_per_million_tokens"]["b"] is None
    assert table["savings-1y"]["ranking"] == [] and table["savings-1y"]["cheapest"] is None
    ranks = {r["label"]: r for r in price_range([a, b, c], "on-demand")}
    # a at 0.7 x 10 = 7 beats b's 8; at 0.85 (8.5) it does not
    assert ranks["a"]["ranks"] == {"0.70": 1, "0.85": 2, "1.00": 2, "1.15": 2, "1.30": 3}
    assert ranks["a"]["ties_at"] == pytest.approx(0.8)
    assert ranks["b"]["ties_at"] == pytest.approx(10 / 8)
    # c's porting-like extra (0.5) does not scale: it ties b's 8 when its compute is 7.5, i.e. x 7.5/12
    assert ranks["c"]["ties_at"] == pytest.approx(7.5 / 12)


def test_cost_config_file_sets_purchase_and_prices(tmp_path, capsys):
    conf = tmp_path / "cost.toml"
    conf.write_text('[cost]\npurchase = "spot"\nfailures = "none"\n'
                    'price_per_node_hour_usd = { trn3-ultraserver = 400.0 }\n')
    base = ["compare", "--model", "llama3-8b", "--train-tokens", "1e9", "--seq", "2048", "--global-batch", "1152",
            "--targets", "p5.48xlarge:1,trn3-ultraserver:1", "--json", "--config", str(conf)]
    assert main(base) == 0
    data = json.loads(capsys.readouterr().out)
    p5, trn3 = data["rows"]
    assert data["purchase"] == "spot" and p5["price_usd_per_node_hour"] == 23.45325
    assert trn3["price_usd_per_node_hour"] == 400.0 and trn3["price_label"] == "given by the user"
    assert main([*base, "--purchase", "on-demand"]) == 0  # the flag wins over the file
    assert json.loads(capsys.readouterr().out)["rows"][0]["price_usd_per_node_hour"] == 55.04
    conf.write_text('[cost]\npurchse = "spot"\n')
    assert main(base) == 2
    assert "cost.purchse: unknown key; allowed: purchase, pue, failures" in capsys.readouterr().err


def test_claims_report_each_claim_with_the_seed_ours_why_and_a_command(capsys):
    """`compare --claims`: five claims, each with the seed's number, ours (made from the rows, not typed in),
    why they differ and the command that reproduces it; Trn3 (no public price) gets a break-even price."""
    from paratrain.cost.claims import run_all

    out = run_all(FAST)
    rows, claims = out["_rows"], out["claims"]
    assert len(claims) == 5 and all(c["seed"] and c["ours"] and c["why"] for c in claims)
    trn, p4d = rows["7b"]
    ratio = trn.cost_usd_per_million_tokens / p4d.cost_usd_per_million_tokens
    assert f"trn1 / p4d = {ratio:.2f}" in " ".join(claims[0]["ours"])
    assert claims[0]["ours"][0].startswith("$/node-hour 21.50 vs 21.96 (on-demand, us-east-1, 2026-11-30")
    for claim, size in ((claims[1], "70b"), (claims[2], "405b")):
        text = " ".join(claim["ours"])
        for run, precision in ((size, "BF16"), (f"{size}-fp8", "FP8")):
            by = {r.system: r for r in rows[run]}
            gpu = min((r for r in rows[run] if r.system.startswith("p")), key=lambda r: r.cost_usd_per_million_tokens)
            trn3 = by["trn3-ultraserver"]
            assert trn3.cost_usd is None and trn3.price_label == "no public price"
            assert trn3.break_even_usd_per_node_hour * trn3.nodes * trn3.wall_hours / trn3.tokens * 1e6 == (
                pytest.approx(gpu.cost_usd_per_million_tokens))
            assert f"{precision}: cheapest GPU {gpu.system} x{gpu.nodes}" in text
            assert f"ties the cheapest GPU at ${trn3.break_even_usd_per_node_hour:,.2f}/node-hour" in text
            assert {r.chips for r in rows[run]} == {1152 if size == "70b" else 4608}  # equal chips per system
        assert "--fp8" in claim["commands"][1] and "--fp8" not in claim["commands"][0]
    # serving (cost/serving.py): the cheapest GPU deployment, and the Trn3 break-even on its node count
    from paratrain.cost.claims import serving_candidates

    target, cands = serving_candidates(FAST)
    gpu = min((c for c in cands if c.system.startswith("p") and c.cost.usd_per_million_tokens is not None),
              key=lambda c: c.cost.usd_per_million_tokens)
    trn3 = next(c for c in cands if c.system == "trn3-ultraserver")
    even = gpu.cost.usd_per_million_tokens * target.rate * (target.prompt + target.output) * 3600 / 1e6 / trn3.cost.nodes
    text = " ".join(claims[3]["ours"])
    assert f"cheapest GPU {gpu.system}: ${gpu.cost.usd_per_million_tokens:.3f}" in text
    assert f"trn3-ultraserver: no on-demand price; on {trn3.cost.nodes} nodes it ties the cheapest GPU at ${even:,.2f}" in text
    by = {r.system: r for r in rows["70b"]}
    gen = by["trn3-ultraserver"].tokens_per_mwh / by["trn2-ultraserver"].tokens_per_mwh
    text = " ".join(claims[4]["ours"])
    assert f"trn3-ultraserver / trn2-ultraserver: {gen:.2f}x tokens per MWh" in text
    assert "trainium2 500 W (hardware-facts.md" in text and "trainium3 1000 W (press reports" in text
    # the Markdown table docs/cost.md pastes: one row per claim, then every command once
    from paratrain.cost.claims import markdown

    table = markdown(out)
    assert table.count("\n| ") == 5 and all(c["commands"][0] in table for c in claims if c["commands"])
    # the printed command reproduces the 7B rows
    args = claims[0]["commands"][0].split()[1:]
    assert main([*args, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)["rows"]
    assert [r["cost_usd_per_million_tokens"] for r in again] == pytest.approx(
        [trn.cost_usd_per_million_tokens, p4d.cost_usd_per_million_tokens])


def test_fp8_workload_uses_the_planners_fp8_model(capsys):
    wl = Workload("llama2-7b", 1e10, 4096, 1024)
    fp8 = Workload("llama2-7b", 1e10, 4096, 1024, fp8=True)
    (bf16_p5,) = compare(wl, [("p5.48xlarge", 4)], FAST)
    (fp8_p5,) = compare(fp8, [("p5.48xlarge", 4)], FAST)
    assert fp8_p5.tokens_per_s > bf16_p5.tokens_per_s  # H100: FP8 peak twice BF16
    (bf16_trn1,) = compare(wl, [("trn1.32xlarge", 4)], FAST)
    (fp8_trn1,) = compare(fp8, [("trn1.32xlarge", 4)], FAST)
    assert fp8_trn1.tokens_per_s <= bf16_trn1.tokens_per_s  # Trainium1: FP8 at the BF16 rate, casts on top
    assert main(["compare", "--model", "llama2-7b", "--train-tokens", "1e10", "--targets", "p5.48xlarge:4",
                 "--failures", "daly", "--fp8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["fp8"] is True
    assert data["rows"][0]["tokens_per_s"] == pytest.approx(fp8_p5.tokens_per_s)


def test_claim_break_even_is_against_the_cheapest_gpu_even_when_a_quoted_trainium_is_cheaper():
    from paratrain.cost.claims import _half_cost_lines
    from paratrain.cost.compare import break_even_price

    quote = Assumptions(failures="none", prices={"trn3-ultraserver": 1.0})  # absurdly cheap: the cheapest row
    rows = compare(Workload("llama3-8b", 1e9, 2048, 1152), [("p5.48xlarge", 1), ("trn3-ultraserver", 1),
                                                           ("trn2-ultraserver", 1)], quote)
    p5, trn3, trn2u = rows
    assert trn3.cost_usd_per_million_tokens < p5.cost_usd_per_million_tokens
    vs_gpu = break_even_price(trn2u, p5.cost_usd_per_million_tokens)
    assert trn2u.break_even_usd_per_node_hour != pytest.approx(vs_gpu)  # the row's own is against trn3
    text = " ".join(_half_cost_lines(rows, "BF16"))
    assert f"trn2-ultraserver x1: no public price; ties the cheapest GPU at ${vs_gpu:,.2f}/node-hour" in text
