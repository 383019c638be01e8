"""`paratrain checkpoint list|verify`: what is in a checkpoint directory (local or s3://), and is it intact."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.cli import Output, UserError, command, opt, print_json, show


@dataclass(kw_only=True)
class ListArgs(Output):
    dir: str = opt("checkpoint directory (checkpoint.dir)", positional=True)


@dataclass(kw_only=True)
class VerifyArgs(Output):
    path: str = opt("a checkpoint folder (step_*) or a directory (its newest complete checkpoint)", positional=True)


GROUPS = [("checkpoint", "list and verify training checkpoints")]


@command("checkpoint list", ListArgs, "checkpoints in a directory: step, status, size, layout")
def run_list(args) -> None:
    from paratrain.train.checkpoint_info import describe_dir, print_checkpoints

    rows = describe_dir(args.dir)
    if not rows and not args.json:
        raise UserError(f"no step_* checkpoint folders in {args.dir}")
    print_json(rows) if args.json else print_checkpoints(rows)


@command("checkpoint verify", VerifyArgs,
         "check a checkpoint's files against its manifest (sizes and sha256)")
def run_verify(args) -> int:
    from paratrain.train.checkpoint_info import verify_checkpoint

    r = verify_checkpoint(args.path)
    show(args, r, lambda: print(f"{r['path']}: OK ({r['seconds']:.2f} s)" if r["ok"] else f"{r['path']}: REFUSED: {r['problem']}"))
    return 0 if r["ok"] else 1
