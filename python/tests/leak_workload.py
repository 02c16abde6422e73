"""A workload run as its own process by test_zz_leaks.py: once it has exited, no /dev/shm
name of it or of its children may remain.

    leak_workload.py clean      every message sent is received; fork and spawn children
                                put tensors under file_system; a file_descriptor child is
                                SIGKILLed while it puts; the parent holds named segments of
                                its own and exits without closing anything.
    leak_workload.py in_flight  a message is never received (its receiver exits first), and
                                a file_system child is SIGKILLed while it puts.

Prints one JSON line: {"pid", "children"}.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import torchpar.multiprocessing as tmp  # noqa: E402

import tp_helpers  # noqa: E402


def main():
    mode = sys.argv[1]
    tmp.set_sharing_strategy("file_system")
    mine = [tmp.share_memory_(torch.ones(1000)), tmp.empty_shared(1 << 20)]  # noqa: F841
    children = []
    for method in ("fork", "spawn") if mode == "clean" else ("fork",):
        ctx = tmp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=tp_helpers.put_and_exit, args=(q, "file_system"))
        p.start()
        children.append(p.pid)
        q.get(timeout=tp_helpers.WAIT_S)
        if mode == "clean":
            q.get(timeout=tp_helpers.WAIT_S)  # in_flight: the second stays in the queue
        p.join(tp_helpers.WAIT_S)
    ctx = tmp.get_context("fork")
    q = ctx.Queue(maxsize=4)
    ready = ctx.Event()
    strategy = "file_descriptor" if mode == "clean" else "file_system"
    p = ctx.Process(target=tp_helpers.put_forever, args=(q, ready, strategy))
    p.start()
    children.append(p.pid)
    ready.wait(tp_helpers.WAIT_S)
    q.get(timeout=tp_helpers.WAIT_S)
    p.kill()
    p.join(tp_helpers.WAIT_S)
    while True:  # what the killed child finished is received
        try:
            q.get(timeout=0.2)
        except Exception:  # noqa: BLE001  (queue.Empty)
            break
    print(json.dumps({"pid": os.getpid(), "children": children}), flush=True)


if __name__ == "__main__":
    main()
