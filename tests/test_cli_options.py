"""The CLI generator: --version, config keys as flags (the same as --set, in command-line order), bounds
checked from the option dataclasses, units and defaults in the help."""

from __future__ import annotations

import json
import os

import pytest

from paratrain.cli import build_parser, main


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"paratrain {version('paratrain')}"


def test_config_keys_are_flags_in_order_with_set():
    args = build_parser().parse_args(["train", "--parallel.tp", "2", "--set", "parallel.tp=4", "--train.steps", "5"])
    assert args.set == ["parallel.tp=2", "parallel.tp=4", "train.steps=5"]


def test_a_config_key_flag_reaches_the_config(capsys):
    assert main(["config", "--parallel.tp", "2", "--train.microbatch", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp = 2" in out and "microbatch = 2" in out


def test_a_bound_is_one_line_naming_the_flag(capsys):
    argv = ["plan", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "2", "--top", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["paratrain plan: error: --top = 0: must be >= 1"]


def test_help_names_units_and_shared_defaults():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("plan", "estimate", "compare", "recommend"):
        text = sub[name].format_help()
        assert "--seq SEQ" in text and "(default 4096)" in text and "--global-batch" in text, name


# Flags whose meaning (or default) legitimately differs between the commands that have them, and why.
DIFFERS = {
    "--device": "probe measures the host unless told; verify tests the accelerator present (auto)",
    "--out": "the hardware TOML written: probe has a default path, calibrate writes beside its input",
    "--purchase": "compare/recommend/serve: None = the --config [cost] table's, else on-demand; simulate: on-demand",
    "--price": "the old ambiguous flag, hidden and refused in compare/recommend and simulate",
    "--rate": "serve plan: the rate to plan for; recommend: default 10; simulate: one rate or LO:HI:N",
    "--prompt-tokens": "N (estimate, plan), optional (recommend: per workload), N or LO:HI (simulate)",
    "--output-tokens": "as --prompt-tokens",
    "--seed": "simulate: None = its config's seed (0 unless --config sets one)",
    "--steps": "verify: steps per compared run; compare/simulate: steps of the training run",
    "--top": "how many rows: 10 layouts (plan), 5 deployments (serve plan)",
    "--tp": "estimate: unset = the trainer's parallel.tp default (1); serve: a replica's TP degree, default 1",
    "--pp": "as --tp", "--ep": "as --tp",
}


def _options(parser, path=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif action.option_strings and "." not in action.option_strings[0] and action.dest != "help":
            yield " ".join(path), action


def test_one_flag_one_meaning_across_commands():
    """Every flag spelled the same in two commands has the same type, action and default there, unless it is
    listed (with the reason) in DIFFERS."""
    seen: dict[str, dict] = {}
    for command, action in _options(build_parser()):
        kind = (type(action).__name__, getattr(action.type, "__name__", action.type), repr(action.default))
        seen.setdefault(action.option_strings[0], {}).setdefault(kind, []).append(command)
    clashing = {flag: kinds for flag, kinds in seen.items() if len(kinds) > 1 and flag not in DIFFERS}
    assert not clashing, clashing
    assert {k: sorted(v) for k, v in seen["--seq"].items()} == {
        ("_StoreAction", "int", "4096"): ["compare", "estimate", "plan", "recommend", "simulate"]}


def test_estimate_takes_the_expert_layout(capsys):
    argv = ["estimate", "--model", "mixtral-8x7b", "--hardware", "p5.48xlarge", "--nodes", "2", "--tp", "2",
            "--global-batch", "64", "--json"]
    assert main([*argv, "--ep", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["ep"] == 4
    assert main(["estimate", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "2", "--ep", "4"]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err


def test_schema_options_are_the_schemas_fields(capsys):
    """serve's replica options are generated from plan.serve.Replica (options_of): the same names and defaults,
    so the options build the schema object back unchanged (from_options), and a schema bound is checked."""
    import dataclasses

    from paratrain.cli import check_options, from_options
    from paratrain.plan.serve import Replica
    from paratrain.plan.serve_commands import cmd_simulate
    from paratrain.sim.serving import Engine

    SimulateArgs = cmd_simulate.options  # noqa: N806 (a class)

    def parsed(*flags):
        argv = ["serve", "simulate", "--model", "llama3-8b", "--hardware", "p5.48xlarge", *flags]
        return check_options(SimulateArgs, build_parser().parse_args(argv))

    assert from_options(Replica, parsed()) == Replica() and from_options(Engine, parsed()) == Engine()
    assert from_options(Replica, parsed("--tp", "2", "--kv", "fp8")) == Replica(tp=2, kv="fp8")
    assert {f.name for f in dataclasses.fields(Replica)} <= {f.name for f in dataclasses.fields(SimulateArgs)}
    assert main(["serve", "simulate", "--model", "llama3-8b", "--hardware", "p5.48xlarge", "--max-seqs", "0"]) == 2
    assert "--max-seqs = 0: must be >= 1" in capsys.readouterr().err


def test_simulate_options_are_simconfig_fields_with_its_defaults():
    """simulate's options are generated from SimConfig's (and StragglerConfig's) described fields: one each, the
    flag in the field's unit, the help's default the field's in that unit, and a value given lands in the field."""
    import dataclasses

    from paratrain.cli import check_options, flag_of
    from paratrain.sim.commands import run_simulate
    from paratrain.sim.config import SimConfig, StragglerConfig, config_from_options

    SimulateArgs = run_simulate.options  # noqa: N806 (a class)
    options = {f.metadata["to"]: f for f in dataclasses.fields(SimulateArgs) if "to" in f.metadata}
    described = {f.name for f in dataclasses.fields(SimConfig) if "help" in f.metadata} | {
        f"stragglers.{f.name}" for f in dataclasses.fields(StragglerConfig) if "help" in f.metadata}
    assert set(options) == described and len(described) == 27
    helps = {flag_of(f): f.metadata["help"] for f in options.values()}
    assert "(default 1m)" in helps["--detect"] and "(GB; default 1000)" in helps["--checkpoint-gb"]
    assert "(GB/s; default 100)" in helps["--write-gbps"] and "(default 5m)" in helps["--evict-after"]
    assert "(default 4)" in helps["--staleness-steps"] and "(default daly)" in helps["--interval"]
    argv = ["simulate", "--devices", "16", "--step-time", "10s", "--steps", "5", "--detect", "2m", "--checkpoint-gb",
            "5", "--straggler-duration", "1h", "--repair-dist", "fixed"]
    cfg = config_from_options(check_options(SimulateArgs, build_parser().parse_args(argv)))
    assert (cfg.detect_s, cfg.checkpoint_bytes, cfg.stragglers.mean_duration_s, cfg.repair_distribution) == (
        120, 5e9, 3600, "fixed")
    assert (cfg.restart_s, cfg.write_bytes_per_s) == (SimConfig.restart_s, SimConfig.write_bytes_per_s)


def test_estimate_and_the_planners_layout_default_to_the_trainers_microbatch(capsys):
    """One schema, one default: `estimate --microbatch` and plan.api.Layout.microbatch are train.microbatch's."""
    from paratrain.config import TrainSection
    from paratrain.plan.api import Layout

    trainers = TrainSection.model_fields["microbatch"].default
    assert Layout().microbatch == trainers
    assert main(["estimate", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "2", "--global-batch",
                 "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["microbatch"] == trainers


def test_cost_flags_default_to_the_cost_assumptions(tmp_path):
    """compare/recommend's --pue, --failures, --purchase: unset, the [cost] table, else cost.compare.Assumptions'
    own defaults (also the ones their help shows); a flag wins over the table."""
    from paratrain.cli import check_options
    from paratrain.cost.commands import run_compare
    from paratrain.cost.compare import Assumptions
    from paratrain.cost.inputs import assumptions_from

    def assumed(*flags):
        a = assumptions_from(check_options(run_compare.options, build_parser().parse_args(["compare", *flags])))
        return a.pue, a.failures, a.purchase

    assert assumed() == (Assumptions.pue, Assumptions.failures, Assumptions.purchase)
    table = tmp_path / "cost.toml"
    table.write_text('[cost]\npue = 1.5\nfailures = "daly"\n')
    assert assumed("--config", str(table), "--failures", "none") == (1.5, "none", Assumptions.purchase)
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["compare"].format_help().split())
    assert f"(default {Assumptions.pue})" in text and f"(default {Assumptions.failures})" in text
    assert main(["compare", "--pue", "0.9"]) == 2  # a bound of the schema's field, checked as the flag is parsed
    table.write_text("[cost]\npue = 0.9\n")
    with pytest.raises(ValueError, match="cost.pue = 0.9: allowed: a number >= 1"):  # and in the [cost] table
        assumed("--config", str(table))


def test_a_config_keys_flags_share_its_one_description():
    """--SECTION.KEY (every config-driven command) and estimate's shortcut flag describe a key with the schema's
    own text (its description, else config.FIELD_HELP), the text docs/config.md has."""
    from paratrain.config import FIELD_HELP, TrainConfig

    sub = build_parser()._subparsers._group_actions[0].choices
    train, estimate = (" ".join(sub[name].format_help().split()) for name in ("train", "estimate"))
    assert not TrainConfig.model_fields["model"].annotation.model_fields["layers"].description
    assert "--model.layers V " + FIELD_HELP["model.layers"] in train  # from FIELD_HELP (was blank)
    tp = FIELD_HELP["parallel.tp"]
    assert "--parallel.tp V " + tp[:20] in train and f"{tp} (parallel.tp, default 1)" in estimate


@pytest.mark.parametrize("command, schema", [
    ("launch", "paratrain.launch.torchrun:LaunchSpec"), ("calibrate", "paratrain.calibrate.session:Calibration"),
    ("recommend", "paratrain.cost.recommend:Request"), ("serve simulate", "paratrain.plan.serve:Replica"),
    ("generate", "paratrain.infer.sampling:Sampling")])
def test_a_described_schema_field_is_its_commands_option(command, schema):
    """Each field a part's schema describes (config.options.described: its help and option keywords) is one
    option of the command built from it, with that help and the field's default (the schema is the one place
    both are written); the session and the launch are given typed objects built back from the options."""
    import dataclasses
    import importlib

    module, name = schema.split(":")
    cls = getattr(importlib.import_module(module), name)
    parser = build_parser()
    for word in command.split():
        parser = next(a for a in parser._actions if a.dest in ("command", f"{parser.prog.split()[-1]}_command")
                      ).choices[word]
    actions = {a.dest: a for a in parser._actions}
    described = [f for f in dataclasses.fields(cls) if "help" in f.metadata]
    assert len(described) >= 4
    for f in described:
        action = actions[f.name]
        assert action.help.startswith(f.metadata["help"].replace("%", "%%")), (f.name, action.help)
        missing = dataclasses.MISSING
        default = f.default if f.default is not missing else None if f.default_factory is missing else (
            f.default_factory())  # a required field (no default): none
        default = os.environ.get(f.metadata["env"], default) if "env" in f.metadata else default  # torchrun's
        assert action.default == default, f.name
