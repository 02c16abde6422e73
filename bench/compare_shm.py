#!/usr/bin/python3
"""Runs bench/shm/shm_bench.cpp and its PyTorch peer side by side, alternating
(ours, peer, ours, peer, ...) for ROUNDS rounds, and prints medians and ratios.

usage: bench/compare_shm.py BUILD_DIR [--rounds N] [--quick]
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = {4096: "4 KiB", 1 << 20: "1 MiB", 64 << 20: "64 MiB"}


def run_ours(build, quick):
    out = subprocess.run(
        [str(Path(build) / "bin" / "shm_bench"), "--benchmark_format=json",
         "--benchmark_filter=BM_(ShareMemory|DumpsLoads|Memcpy|SegmentCreateTouch)",
         f"--benchmark_min_time={0.05 if quick else 0.3}"],
        check=True, capture_output=True, text=True).stdout
    res = {}
    for b in json.loads(out)["benchmarks"]:
        res[b["name"]] = b["real_time"]  # microseconds (the benchmarks use kMicrosecond)
    return res


def run_peer(quick):
    cmd = ["/usr/bin/python3", str(HERE / "peers" / "torch_share_memory.py")]
    if quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.splitlines():
        r = json.loads(line)
        res[f'{r["name"]}/{r["bytes"]}'] = r["median_us"]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    ours, peer = [], []
    for _ in range(a.rounds):
        ours.append(run_ours(a.build, a.quick))
        peer.append(run_peer(a.quick))
    med = lambda runs, k: statistics.median(r[k] for r in runs)
    rows = []
    for n, label in SIZES.items():
        memcpy = med(ours, f"BM_Memcpy/{n}")
        rows.append((f"share_memory_ {label} (steady)", med(ours, f"BM_ShareMemorySteady/{n}"),
                     "torch share_memory_", med(peer, f"torch_share_memory_/{n}"), memcpy))
        rows.append((f"share_memory_ {label} (cold)", med(ours, f"BM_ShareMemoryCold/{n}"),
                     "torch share_memory_", med(peer, f"torch_share_memory_/{n}"), memcpy))
        for strat in ("file_descriptor", "file_system"):
            rows.append((f"dumps+loads shared {label}", med(ours, f"BM_DumpsLoads/bytes:{n}/copy:0"),
                         f"ForkingPickler {strat}", med(peer, f"torch_pickle_shared_{strat}/{n}"), None))
        rows.append((f"dumps+loads copy {label}", med(ours, f"BM_DumpsLoads/bytes:{n}/copy:1"),
                     "-", None, memcpy))
    print(f"| torchpar | us | peer | us | peer/torchpar | memcpy us (limit) |")
    print("|---|---:|---|---:|---:|---:|")
    for name, us, pname, pus, limit in rows:
        ratio = f"{pus / us:.1f}x" if pus else "-"
        print(f"| {name} | {us:.1f} | {pname} | {pus if pus is None else round(pus, 1)} | {ratio} | "
              f"{'-' if limit is None else round(limit, 1)} |")
    for n, label in SIZES.items():
        if n >= (1 << 20):
            print(f"\nfresh segment create+touch {label}: {med(ours, f'BM_SegmentCreateTouch/{n}'):.1f} us")


if __name__ == "__main__":
    sys.exit(main())
