"""What is in a checkpoint directory, as `paratrain checkpoint list` shows it."""

from __future__ import annotations

import json
import time


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


def verify_checkpoint(path: str) -> dict:
    """`paratrain checkpoint verify`: a checkpoint folder (or a directory's newest complete one) against its
    manifest: {path, ok, problem, seconds}."""
    from paratrain.train.checkpoint import CheckpointManager

    mgr = CheckpointManager(path, log=lambda _msg: None)
    storage, path = mgr._resolve_source(path)
    t0 = time.perf_counter()
    problem = mgr.verify(path, storage)
    return {"path": path, "ok": problem is None, "problem": problem, "seconds": time.perf_counter() - t0}


def print_checkpoints(rows: list[dict]) -> None:
    from paratrain.train.checkpoint import format_layout

    print(f"{'step':>10}  {'status':<11} {'MiB':>9}  {'saved':<19}  layout")
    for r in rows:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created_unix_s"])) if "created_unix_s" in r else "-"
        layout = format_layout(r["layout"], r["world_size"]) if "layout" in r else "-"
        print(f"{r['step']:>10}  {r['status']:<11} {r['bytes'] / 2**20:>9.1f}  {saved:<19}  {layout}")
        if "refused_because" in r:
            print(f"{'':>12}refused: {r['refused_because']}")
