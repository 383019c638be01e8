"""`paratrain checkpoint list|verify`: what is in a checkpoint directory (local or s3://), and is it intact."""

from __future__ import annotations

import argparse
import json
import time

HELP = """\
Inspect checkpoints written by `paratrain train` (local path, shared filesystem or s3://bucket/prefix).

  paratrain checkpoint list runs/default/checkpoints          steps, status, size, layout
  paratrain checkpoint verify runs/default/checkpoints        check the newest complete one against its manifest
  paratrain checkpoint verify s3://bucket/run/step_00000100   check one checkpoint (sha256 of every file)

Status: complete (has MANIFEST.json, written last at save), interrupted (no manifest: a save that never
finished; removed at the next resume), refused (failed verification at a resume; kept for inspection).
S3 endpoint/credentials/region come from the usual AWS environment (AWS_ENDPOINT_URL, AWS_PROFILE, ...).
"""


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="list and verify training checkpoints", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    csub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    ls = csub.add_parser("list", help="checkpoints in a directory: step, status, size, layout")
    ls.add_argument("dir", help="checkpoint directory (checkpoint.dir)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=run_list)
    ver = csub.add_parser("verify", help="check a checkpoint's files against its manifest (sizes and sha256)")
    ver.add_argument("path", help="a checkpoint folder (step_*) or a directory (its newest complete checkpoint)")
    ver.add_argument("--json", action="store_true", help="print JSON")
    ver.set_defaults(func=run_verify)
    p.set_defaults(func=lambda args: p.print_help() or 0)


def describe_dir(directory: str) -> list[dict]:
    from paratrain.train.checkpoint import MANIFEST, REFUSED, CheckpointManager

    mgr = CheckpointManager(directory, log=lambda _msg: None)
    rows = []
    for step, path, files in mgr._step_dirs():
        status = "refused" if REFUSED in files else "complete" if MANIFEST in files else "interrupted"
        row = {"step": step, "path": path, "status": status, "bytes": sum(s or 0 for s in files.values())}
        if MANIFEST in files:
            manifest = json.loads(mgr.storage.read_bytes(f"{path}/{MANIFEST}"))
            row.update(world_size=manifest["world_size"], layout=manifest["layout"],
                       created_unix_s=manifest["created_unix_s"], format=manifest.get("format"))
        if REFUSED in files:
            row["refused_because"] = json.loads(mgr.storage.read_bytes(f"{path}/{REFUSED}"))["reason"]
        rows.append(row)
    return rows


def run_list(args) -> int:
    from paratrain.cli import UserError
    from paratrain.train.checkpoint import format_layout

    rows = describe_dir(args.dir)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        raise UserError(f"no step_* checkpoint folders in {args.dir}")
    print(f"{'step':>10}  {'status':<11} {'MiB':>9}  {'saved':<19}  layout")
    for r in rows:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created_unix_s"])) if "created_unix_s" in r else "-"
        layout = format_layout(r["layout"], r["world_size"]) if "layout" in r else "-"
        print(f"{r['step']:>10}  {r['status']:<11} {r['bytes'] / 2**20:>9.1f}  {saved:<19}  {layout}")
        if "refused_because" in r:
            print(f"{'':>12}refused: {r['refused_because']}")
    return 0


def run_verify(args) -> int:
    from paratrain.train.checkpoint import CheckpointManager

    mgr = CheckpointManager(args.path, log=lambda _msg: None)
    storage, path = mgr._resolve_source(args.path)
    t0 = time.perf_counter()
    problem = mgr.verify(path, storage)
    result = {"path": path, "ok": problem is None, "problem": problem, "seconds": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{path}: OK ({result['seconds']:.2f} s)" if problem is None else f"{path}: REFUSED: {problem}")
    return 0 if problem is None else 1
