"""`paratrain data prepare` throughput and memory: tokens/s with 1 and 2 workers, and peak RSS for a corpus
ten times larger than the first, to show that memory does not grow with the corpus (streaming).

The corpus is a JSONL file of {"text": ...} records made from this Python's standard library source
(cycled to the size asked; the large corpus is the small one ten times, so only the size changes), tokenized with a byte-level BPE tokenizer.json trained once on its first
2 MB (so the runs measure tokenization, not tokenizer training). Each measurement runs `prepare` in a
fresh process and reads that process's peak RSS (and its workers' largest) from getrusage.

  python benchmarks/data_prepare.py --mb 4            # 4 MB and 40 MB corpora; record with the load average
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, threading, time
from paratrain.config import load_config
from paratrain.train.data import prepare, read_meta

def status_kib(pid, key):  # VmRSS / VmHWM of one process, from /proc (per address space: exact after exec)
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        return 0
    return 0

def children(pid):
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
    except OSError:
        return []

src, out, tok, workers = sys.argv[1:5]
cfg = load_config(None, [f'data.source="{src}"', f'data.prepared_dir="{out}"', f'data.tokenizer="{tok}"',
                         f"data.workers={workers}"]).data
baseline = status_kib("self", "VmRSS:")
worker_peak, done = [0], threading.Event()

def poll():
    while not done.wait(0.1):
        for c in children(os.getpid()):
            try:  # a worker after its exec (between fork and exec it still shows this process's memory)
                if b"spawn_main" not in open(f"/proc/{c}/cmdline", "rb").read():
                    continue
            except OSError:
                continue
            worker_peak[0] = max(worker_peak[0], status_kib(c, "VmHWM:"))

threading.Thread(target=poll, daemon=True).start()
def cpu_s():  # this process and its (finished) workers, user + system
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                       resource.RUSAGE_CHILDREN)))

t0, c0 = time.perf_counter(), cpu_s()
prepare(cfg, log=lambda *_: None, progress=False)
wall, cpu = time.perf_counter() - t0, cpu_s() - c0
done.set()
meta = read_meta(out)
print(json.dumps({"tokens": meta["train_tokens"] + meta["val_tokens"], "wall_s": wall, "cpu_s": cpu,
                  "rss_before_bytes": baseline * 1024, "rss_main_bytes": status_kib("self", "VmHWM:") * 1024,
                  "rss_worker_bytes": worker_peak[0] * 1024}))
"""

def make_corpus(path: Path, size_bytes: int) -> int:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    written = 0
    with open(path, "w", encoding="utf-8") as fh:
        while written < size_bytes:
            for p in files:
                line = json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")}) + "\n"
                fh.write(line)
                written += len(line.encode())
                if written >= size_bytes:
                    break
    return written


def train_tokenizer(corpus: Path, out: Path) -> None:
    from paratrain.train.data.tokenize import train_bpe

    texts, size = [], 0
    with open(corpus, encoding="utf-8") as fh:
        for line in fh:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size > 2_000_000:
                break
    train_bpe(texts, 4096).save(str(out))


def measure(corpus: Path, tok: Path, workers: int, work: Path) -> dict:
    out = work / f"out-{corpus.stem}-{workers}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(corpus), str(out), str(tok), str(workers)],
                          capture_output=True, text=True, env=env, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r.update(corpus_bytes=corpus.stat().st_size, workers=workers, tokens_per_s=r["tokens"] / r["wall_s"],
             cores_used=r["cpu_s"] / r["wall_s"])  # < workers on a loaded machine: the speed-up it allowed
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=4.0, help="size of the first corpus (the second is 10x)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        small, large = work / "small.jsonl", work / "large.jsonl"
        make_corpus(small, int(args.mb * 1e6))
        with open(large, "wb") as fh:  # the same documents ten times: only the size changes
            for _ in range(10):
                fh.write(small.read_bytes())
        tok = work / "tokenizer.json"
        train_tokenizer(small, tok)
        load_before = open("/proc/loadavg").read().split()[:3]
        t0 = time.perf_counter()
        runs = [measure(corpus, tok, w, work) for corpus in (small, large) for w in (1, 2)]
        load_after = open("/proc/loadavg").read().split()[:3]
    result = {"runs": runs, "loadavg_before": load_before, "loadavg_after": load_after,
              "speedup_2_workers": [runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"],
                                    runs[3]["tokens_per_s"] / runs[2]["tokens_per_s"]],
              "rss_ratio_10x_corpus": [runs[2]["rss_main_bytes"] / runs[0]["rss_main_bytes"],
                                       runs[3]["rss_main_bytes"] / runs[1]["rss_main_bytes"]],
              "worker_rss_ratio_10x_corpus": runs[3]["rss_worker_bytes"] / runs[1]["rss_worker_bytes"],
              "bench_wall_s": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'corpus':>10} {'workers':>7} {'tokens':>12} {'tokens/s':>10} {'cores used':>10} {'RSS at start':>13} "
          f"{'peak main':>10} {'peak worker':>11}")
    for r in runs:
        print(f"{r['corpus_bytes'] / 1e6:>8.1f}MB {r['workers']:>7} {r['tokens']:>12,} {r['tokens_per_s']:>10,.0f} "
              f"{r['cores_used']:>10.2f} "
              f"{r['rss_before_bytes'] / 2**20:>10.0f}MiB {r['rss_main_bytes'] / 2**20:>7.0f}MiB "
              f"{r['rss_worker_bytes'] / 2**20:>8.0f}MiB")
    s, m = result["speedup_2_workers"], result["rss_ratio_10x_corpus"]
    print(f"2 workers / 1 worker tokens/s: {s[0]:.2f}x (1x corpus), {s[1]:.2f}x (10x corpus); peak RSS of the 10x "
          f"corpus / the 1x: main {m[0]:.2f}x (1 worker), {m[1]:.2f}x (2 workers), worker "
          f"{result['worker_rss_ratio_10x_corpus']:.2f}x; load average {' '.join(load_before)} -> "
          f"{' '.join(load_after)}")


if __name__ == "__main__":
    main()
