"""The DataLoader "Too many open files" case of issue 39, run as its own process.

    dataloader_fd_case.py {torchpar|torch} BATCHES [BATCH_LEN] [--keep]

Lowers this process's RLIMIT_NOFILE soft limit to 1024 (`ulimit -n 1024`) before torch's
DataLoader is imported, then iterates a DataLoader with 4 fork workers whose batches are
lists of BATCH_LEN (default 64) small tensors, keeping every batch alive with --keep (as a
loop collecting outputs does). `torchpar` passes multiprocessing_context=
torchpar.multiprocessing.get_context("fork"); `torch` leaves DataLoader's default
(torch.multiprocessing, file_descriptor strategy: one fd per shared storage).

Prints one JSON line: {"ctx", "batches" (completed), "ok", "error" (type: message, or
null), "fds" (open fds of this process at the end, workers shut down), "seconds"}.
Exit code 0 whether or not the DataLoader failed (the JSON says); 1 if this script broke.
"""
import json
import os
import resource
import sys
import time

FD_LIMIT = 1024
WORKERS = 4


class SmallTensors:
    """Sample i is a 3-element float tensor filled with i (deterministic)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch
        return torch.full((3,), float(i))


def as_list(samples):
    """collate_fn: the batch is the list of its samples (each a tensor of its own)."""
    return list(samples)


def main():
    which, batches = sys.argv[1], int(sys.argv[2])
    batch_len = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else 64
    keep = "--keep" in sys.argv
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(FD_LIMIT, hard), hard))

    import torch
    from torch.utils.data import DataLoader

    kwargs = {}
    if which == "torchpar":
        import torchpar.multiprocessing as tmp
        kwargs["multiprocessing_context"] = tmp.get_context("fork")
    loader = DataLoader(SmallTensors(batches * batch_len), batch_size=batch_len,
                        num_workers=WORKERS, collate_fn=as_list, **kwargs)
    kept, done, error = [], 0, None
    t0 = time.monotonic()
    try:
        for i, batch in enumerate(loader):
            assert len(batch) == batch_len
            assert batch[0][0].item() == i * batch_len and batch[-1][0].item() == (
                i + 1) * batch_len - 1
            if keep:
                kept.append(batch)
            done += 1
    except Exception as e:  # noqa: BLE001  (the outcome is the report)
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    del loader  # shuts the workers down
    print(json.dumps({"ctx": which, "batches": done, "ok": error is None and done == batches,
                      "error": error, "fds": len(os.listdir("/proc/self/fd")),
                      "seconds": round(seconds, 2)}), flush=True)


if __name__ == "__main__":
    main()
