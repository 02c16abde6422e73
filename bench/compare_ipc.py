#!/usr/bin/python3
"""Runs bench/ipc/ipc_bench.cpp and its torch.multiprocessing peer alternately
(ours, peer, ours, peer, ...) and prints medians, the issue's targets and ratios.

usage: bench/compare_ipc.py BUILD_DIR [--rounds N] [--quick]
"""
import argparse
import json
import statistics
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (label, our benchmark, how to read it, peer name, peer unit, target, higher_is_better)
ROWS = [
    ("Queue 4 KiB round trip (us)", "BM_QueuePingPong4K/real_time", "us", "queue_pingpong_4k", 25, False),
    ("Queue 4 KiB one way (items/s)", "BM_QueueOneWay4K/20000/real_time", "items/s", "queue_oneway_4k", 400000, True),
    ("Pipe 4 KiB round trip (us)", "BM_PipePingPong4K/real_time", "us", "pipe_pingpong_4k", 25, False),
    ("Pipe 4 KiB one way (items/s)", "BM_PipeOneWay4K/20000/real_time", "items/s", "pipe_oneway_4k", None, True),
    ("64 MiB fresh hand-off (ms)", "BM_QueueHandoff64M/resend:0/real_time", "ms", "queue_handoff_64m_fresh", 20, False),
    ("64 MiB re-send (us)", "BM_QueueHandoff64M/resend:1/real_time", "us", "queue_handoff_64m_resend", 50, False),
]


def run_ours(build, quick):
    out = subprocess.run([str(Path(build) / "bin" / "ipc_bench"), "--benchmark_format=json",
                          f"--benchmark_min_time={0.1 if quick else 0.5}"],
                         check=True, capture_output=True, text=True).stdout
    res = {}
    for b in json.loads(out)["benchmarks"]:
        unit = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b["time_unit"]]
        res[b["name"]] = {"us": b["real_time"] * unit, "items/s": b.get("items_per_second", 0.0)}
    return res


def run_peer(quick):
    cmd = ["/usr/bin/python3", str(HERE / "peers" / "torch_ipc.py")] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {(r["name"], r["strategy"]): r["value"] for r in map(json.loads, out.splitlines())}


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
    print("| measure | torchpar | torch.mp file_descriptor | torch.mp file_system | ratio vs best peer | target | met |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for label, name, unit, pname, target, higher in ROWS:
        key = "items/s" if unit == "items/s" else "us"
        mine = statistics.median(r[name][key] for r in ours)
        if unit == "ms":
            mine /= 1e3
        fd = statistics.median(p[(pname, "file_descriptor")] for p in peer)
        fs = statistics.median(p[(pname, "file_system")] for p in peer)
        best = max(fd, fs) if higher else min(fd, fs)
        ratio = mine / best if higher else best / mine
        met = "-" if target is None else ("yes" if (mine >= target if higher else mine <= target) else "no")
        print(f"| {label} | {mine:,.1f} | {fd:,.1f} | {fs:,.1f} | {ratio:,.1f}x | "
              f"{'-' if target is None else f'{target:,}'} | {met} |")


if __name__ == "__main__":
    main()
