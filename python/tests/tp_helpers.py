"""Helpers of torchpar's pytest suite: child-process bodies and process bookkeeping.

The bodies live here, in a module of their own, because spawn and forkserver children
import the function they run by name: a module on sys.path (the tests directory, which
multiprocessing passes to the child) that imports nothing of pytest's is the cheapest.

start() records every child's pid, so the last test (test_zz_leaks.py) can assert that no
child is left and that no /dev/shm name of theirs outlived them.
"""
import os
import queue
import signal
import sys
import time

import numpy as np
import torch

import torchpar.multiprocessing as tmp

#: Seconds any single blocking call in a test may take before the test counts it as hung.
WAIT_S = 30.0

#: Pids of every child this test run started (start()).
CHILD_PIDS = set()


def start(ctx, target, *args):
    """Starts ctx.Process(target, args) as a daemon, records its pid and returns it."""
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    CHILD_PIDS.add(p.pid)
    return p


def finish(p, timeout=WAIT_S):
    """Joins `p` within `timeout` seconds (killing it if it is still alive) and returns its
    exit code; AssertionError when it had to be killed."""
    p.join(timeout)
    if p.is_alive():
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.join(5)
        raise AssertionError(f"child {p.pid} did not finish within {timeout} s")
    return p.exitcode


def get_from(q, p, timeout=WAIT_S):
    """q.get() of a message child `p` sends, failing at once (with its exit code) when `p`
    exits without sending, rather than after the whole `timeout` (seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if not p.is_alive():
                try:
                    return q.get(timeout=0.2)  # sent just before it exited
                except queue.Empty:
                    raise AssertionError(f"child {p.pid} exited ({p.exitcode}) without "
                                         "sending") from None
            if time.monotonic() > deadline:
                raise


def wait_until_blocked_in(thread_id, func_name, timeout=WAIT_S):
    """Returns once thread `thread_id`'s innermost Python frame is `func_name` (it is then
    inside the C call that blocks there); AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread_id)
        if frame is not None and frame.f_code.co_name == func_name:
            time.sleep(0.05)  # polling: let it reach the wait inside that call
            frame = sys._current_frames().get(thread_id)
            if frame is not None and frame.f_code.co_name == func_name:
                return
        time.sleep(0.005)
    raise AssertionError(f"thread {thread_id} never blocked in {func_name}")


def proc_state(pid):
    """The state letter of process `pid` in /proc (R, S, T, Z, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def stop(pid, timeout=WAIT_S):
    """SIGSTOPs `pid` and returns once the kernel shows it stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while proc_state(pid) not in ("T", "t"):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop")
        time.sleep(0.001)


def live_children():
    """Pids of this process's live (not zombie) children, read from /proc."""
    me = os.getpid()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            pids.append(int(name))
    return pids


def shm_names_of(pids):
    """/dev/shm names torchpar made for processes in `pids` (torchpar_<pid>_...)."""
    pids = {str(p) for p in pids}
    return sorted(n for n in os.listdir("/dev/shm")
                  if n.startswith("torchpar_") and n.split("_")[1] in pids)


def names_left_after_exit(pids, timeout=5.0):
    """shm_names_of(pids) once their cleaners had `timeout` seconds to unlink them (the
    processes in `pids` have exited)."""
    deadline = time.monotonic() + timeout
    while True:
        left = shm_names_of(pids)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def unlink_shm(names):
    """Removes /dev/shm/<name> for each name (a known leak a test provoked)."""
    for n in names:
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------------------
# Child bodies. Each sets the sharing strategy it is given (the start method may not carry
# the parent's over) and reports failures by exit code or through its queue.

def echo(q_in, q_out, strategy):
    """Puts back everything it gets from q_in until it gets None."""
    tmp.set_sharing_strategy(strategy)
    while True:
        obj = q_in.get(timeout=WAIT_S)
        if obj is None:
            return
        q_out.put(obj)


def write_in_place(q_in, q_out, strategy):
    """Gets (a, view_of_a, b, c) where b and c share one storage, checks the aliasing in
    this process, writes through each and reports what it saw."""
    tmp.set_sharing_strategy(strategy)
    a, view, b, c = q_in.get(timeout=WAIT_S)
    seen = {
        "view_aliases": view.data_ptr() == a.data_ptr() + 2 * a.element_size(),
        "b_c_share": b.storage().data_ptr() == c.storage().data_ptr(),
        "shared": all(tmp.is_shared(t) for t in (a, view, b, c)),
    }
    view.fill_(7.0)        # a[2:5] through the view
    a[0] = 42.0
    b.add_(1.0)            # c sees it too (same storage)
    seen["a_after"] = a.tolist()
    seen["c_after"] = c.tolist()
    q_out.put(seen)


def parameter_report(q_in, q_out, strategy):
    """Gets a Parameter and a leaf tensor requiring grad, reports their type and flags,
    and sends them back."""
    tmp.set_sharing_strategy(strategy)
    p, leaf = q_in.get(timeout=WAIT_S)
    q_out.put({
        "p_type": type(p).__name__, "p_grad": p.requires_grad,
        "leaf_type": type(leaf).__name__, "leaf_grad": leaf.requires_grad,
    })
    q_out.put((p, leaf))


def put_and_exit(q, strategy):
    """Puts a tensor, then a dict of tensors, and exits at once (before the parent loads
    them)."""
    tmp.set_sharing_strategy(strategy)
    q.put(torch.arange(1000, dtype=torch.float32))
    q.put({"t": torch.arange(1000, dtype=torch.float32),
           "more": [torch.ones(3), torch.zeros(2)]})


def put_forever(q, ready, strategy):
    """Puts small tensors and ints as fast as the queue takes them, until it is killed."""
    tmp.set_sharing_strategy(strategy)
    ready.set()
    i = 0
    while True:
        q.put((i, torch.full((4,), float(i))))
        i += 1


def get_forever(q, ready):
    """Gets as fast as it can, until it is killed (a consumer to stop mid-get)."""
    ready.set()
    while True:
        try:
            q.get(timeout=0.05)
        except Exception:  # noqa: BLE001  (Empty: try again)
            pass


def joinable_worker(q, n):
    """Takes n items from a JoinableQueue, calling task_done for each."""
    for _ in range(n):
        q.get(timeout=WAIT_S)
        q.task_done()


def pipe_echo(conn):
    """Echoes objects and byte messages over a duplex Connection until it gets None."""
    while True:
        kind, payload = conn.recv()
        if kind is None:
            conn.close()
            return
        if kind == "bytes":
            conn.send_bytes(conn.recv_bytes())
        elif kind == "write":
            payload.mul_(2)         # the parent sees it: the tensor is shared
            conn.send("written")
        else:
            conn.send(payload)


def pipe_write_only(cue, w):
    """Waits for a cue, then sends 3 byte messages on a send-only end and exits."""
    cue.recv()
    for i in range(3):
        w.send_bytes(bytes([i]) * (i + 1))


def numpy_roundtrip_payload():
    """Arrays above and below the out-of-band threshold, and other dtypes and shapes."""
    rng = np.random.default_rng(1234)
    return {
        "large": rng.standard_normal((256, 257)),                  # 514 KiB: out of band
        "small": np.arange(10, dtype=np.int16),                    # in band
        "bool": np.array([True, False, True]),
        "strided": np.arange(200000, dtype=np.int32)[::3],         # non-contiguous
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def tensor_dict(n=16):
    """n small tensors of different dtypes and shapes, keyed by name."""
    g = torch.Generator().manual_seed(n)
    d = {}
    for i in range(n):
        if i % 3 == 0:
            d[f"t{i}"] = torch.randn(4, i + 1, generator=g)
        elif i % 3 == 1:
            d[f"t{i}"] = torch.randint(0, 100, (i + 2,), generator=g)
        else:
            d[f"t{i}"] = torch.rand(2, 2, 2, generator=g) > 0.5
    return d


def busy_count(stop, counter):
    """Counts in pure Python until `stop` is set (the thread of the GIL test)."""
    while not stop.is_set():
        counter[0] += 1
