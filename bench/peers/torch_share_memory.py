#!/usr/bin/python3
"""Peer of bench/shm/shm_bench.cpp: the same work in PyTorch (Debian's python3-torch).

share_memory_ of a fresh 4 KiB / 1 MiB / 64 MiB float tensor (PyTorch creates a new
segment every time), and a pickle round trip through ForkingPickler with the tensor's
storage shared (what torch.multiprocessing queues send) under both sharing strategies.
Prints one JSON object per line: {"name", "bytes", "median_us"}.
"""
import io
import json
import pickle
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

torch.set_num_threads(1)
SIZES = [4 << 10, 1 << 20, 64 << 20]


def median_us(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main():
    quick = "--quick" in sys.argv
    for nbytes in SIZES:
        reps = (3 if quick else 5) if nbytes >= (64 << 20) else (50 if quick else 300)
        src = torch.ones(nbytes // 4)

        def share():
            t = src.clone()
            t.share_memory_()

        print(json.dumps({"name": "torch_share_memory_", "bytes": nbytes,
                          "median_us": median_us(share, reps)}), flush=True)
        for strategy in ("file_descriptor", "file_system"):
            mp.set_sharing_strategy(strategy)
            shared = src.clone().share_memory_()

            def round_trip():
                buf = io.BytesIO()
                ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(shared)
                pickle.loads(buf.getvalue())

            print(json.dumps({"name": f"torch_pickle_shared_{strategy}", "bytes": nbytes,
                              "median_us": median_us(round_trip, reps)}), flush=True)
        mp.set_sharing_strategy("file_descriptor")


if __name__ == "__main__":
    main()
