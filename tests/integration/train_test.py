#!/usr/bin/python3
"""`torchpar train` end to end: the data loader on the real files and on a truncated and a
wrong-magic copy; a short run of each strategy (metrics.json fields, ddp's time in
synchronize_gradients, accuracy clearly above chance and, for pserver, within 6 points of
single (its trainer steps on parameters a push or two stale: 23 runs on one VM gave 62.3-67.3%
against single's 67.0%); model.pt, curves.png); ddp as the ranks of `torchpar run -n 2`
(within 2 points of --workers 2, only rank 0 reporting; --no-plot draws no curves.png); a ddp
worker and the pserver server SIGKILLed mid-run end the run naming them (pserver: the trainers
fail on their own, naming the server, within the timeout), with no process left behind.
usage: train_test.py BIN_DIR"""
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BIN = sys.argv[1]
TORCHPAR = os.path.join(BIN, "torchpar")
DATA = "/usr/share/datasets/fashion-mnist"
FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
         "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def train(*args, timeout=300):
    p = subprocess.run([TORCHPAR, "train", *args], capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def children(pid):
    """The child processes of `pid`, in the order they started."""
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    started = {}
    for k in kids:
        try:
            stat = open(f"/proc/{k}/stat").read()
        except OSError:
            continue
        started[int(k)] = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22: starttime
    return sorted(started, key=lambda k: (started[k], k))


def kill_mid_run(log_name, args, pick):
    """Starts `torchpar train args`, SIGKILLs pick(children) once training is under way.
    Returns (exit code or None, seconds from the kill to the exit, output, children, victim);
    victim is None when there were no children to pick from (the run is killed)."""
    log = open(os.path.join(tmp, log_name), "w+")
    p = subprocess.Popen([TORCHPAR, "train", *args], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        log.seek(0)
        if "samples/s" in log.read():  # training is under way
            break
        time.sleep(0.2)
    kids = children(p.pid)
    victim = pick(kids) if kids else None
    if victim is None:
        p.kill()
        p.wait()
        return None, 0, "", kids, None
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    try:
        code = p.wait(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        code = None
    took = time.time() - t0
    log.seek(0)
    return code, took, log.read(), kids, victim


def left_behind(pids):
    time.sleep(0.3)
    return [w for w in pids if os.path.exists(f"/proc/{w}") and
            open(f"/proc/{w}/stat").read().split()[2] != "Z"]


tmp = tempfile.mkdtemp(prefix="torchpar_train_test_")
try:
    # ---- bad data: missing, truncated, wrong magic -> exit 2, file named, nothing in --out
    missing = os.path.join(tmp, "missing")
    os.makedirs(missing)
    out = os.path.join(tmp, "out_missing")
    code, _, err = train("--strategy", "single", "--data", missing, "--out", out)
    check(code == 2 and "train-images-idx3-ubyte.gz" in err and "install-deps" in err,
          f"missing files: exit {code}, message names the file and the install command: {err.strip()[:160]}")
    check(not os.path.exists(out), "missing files: --out not created")

    trunc = os.path.join(tmp, "truncated")
    shutil.copytree(DATA, trunc)
    with gzip.open(os.path.join(DATA, FILES[0])) as f:
        head = f.read(16 + 28 * 28 * 100)  # header + 100 of 60,000 images
    with gzip.open(os.path.join(trunc, FILES[0]), "wb") as f:
        f.write(head)
    out = os.path.join(tmp, "out_trunc")
    code, _, err = train("--strategy", "single", "--data", trunc, "--out", out)
    check(code == 2 and "truncated" in err and FILES[0] in err,
          f"truncated images file: exit {code}: {err.strip()[:160]}")
    check(not os.path.exists(out), "truncated: --out not created")

    magic = os.path.join(tmp, "magic")
    shutil.copytree(DATA, magic)
    shutil.copy(os.path.join(DATA, FILES[1]), os.path.join(magic, FILES[2]))  # labels as images
    code, _, err = train("--strategy", "single", "--data", magic, "--out", os.path.join(tmp, "o3"))
    check(code == 2 and "magic" in err and FILES[2] in err,
          f"wrong magic: exit {code}: {err.strip()[:160]}")

    # ---- an unwritable --out is reported before training, not after
    blocker = os.path.join(tmp, "a_file")
    open(blocker, "w").close()
    t0 = time.time()
    code, so, err = train("--strategy", "single", "--limit", "600", "--out",
                          os.path.join(blocker, "sub"))
    check(code == 2 and "not writable" in err and "a_file" in err and "test accuracy" not in so,
          f"unwritable --out: exit {code} before training: {err.strip()[:160]}")

    # ---- shell metacharacters in every path option reach the program as they are
    weird = "x'; touch INJECTED; echo '$(touch INJECTED2) \"q\" `touch INJECTED3`"
    weird_data = os.path.join(tmp, "data " + weird)
    os.symlink(DATA, weird_data)
    code, so, err = train("--strategy", "single", "--limit", "600", "--batch-size", "64",
                          "--data", weird_data, "--out", os.path.join(tmp, weird), timeout=300)
    injected = [f for f in os.listdir(tmp) + os.listdir(os.getcwd()) if f.startswith("INJECTED")]
    check(code == 0, f"metacharacters in --data/--out: exit {code}: {err.strip()[-200:]}")
    check(not injected, f"metacharacters in paths ran nothing: {injected}")
    check(os.path.exists(os.path.join(tmp, weird, "metrics.json")),
          "metacharacters: metrics.json written under the literal --out")
    check(os.path.exists(os.path.join(tmp, weird, "curves.png")),
          "metacharacters: curves.png drawn (plot started with an argv)")

    # ---- a short run of each strategy (the plot is checked above, on the single run)
    accuracy = {}
    for strategy in ("single", "hogwild", "ddp", "pserver"):
        out = os.path.join(tmp, "run_" + strategy)
        code, so, err = train("--strategy", strategy, "--workers", "2", "--limit", "6000",
                              "--lr", "0.05", "--batch-size", "32", "--no-plot", "--out", out)
        check(code == 0, f"{strategy}: exit {code} {err.strip()[-300:]}")
        if code != 0:
            continue
        m = json.load(open(os.path.join(out, "metrics.json")))
        fields = {"strategy", "workers", "epochs", "total_seconds", "samples_per_s", "versions",
                  "status"}
        check(fields <= set(m), f"{strategy}: metrics.json has {sorted(fields - set(m))} missing")
        e = m["epochs"][0]
        check({"epoch", "train_loss", "test_accuracy", "seconds", "samples_per_s"} <= set(e),
              f"{strategy}: per-epoch fields")
        check(m["strategy"] == strategy and m["status"] == "completed", f"{strategy}: status")
        sync = {"synchronize_seconds", "synchronize_us_per_step", "synchronize_fraction"}
        if strategy == "ddp":  # DistributedDataParallel::stats(): the ranks' mean, > 0, < the epoch
            check(sync <= set(e) and 0 < e["synchronize_seconds"] < e["seconds"] and
                  0 < e["synchronize_fraction"] < 1 and e["synchronize_us_per_step"] > 0,
                  f"ddp: time in synchronize_gradients reported: {[e.get(k) for k in sorted(sync)]}")
        else:
            check(not sync & set(e), f"{strategy}: no synchronize_* fields")
        check(e["test_accuracy"] > 30, f"{strategy}: accuracy {e['test_accuracy']:.1f}% > 30% (chance 10%)")
        accuracy[strategy] = e["test_accuracy"]
        check(os.path.getsize(os.path.join(out, "model.pt")) > 50000, f"{strategy}: model.pt written")
        check(not os.path.exists(os.path.join(out, "curves.png")), f"{strategy}: --no-plot")
        check("test accuracy" in so, f"{strategy}: prints test accuracy")

    if "single" in accuracy and "pserver" in accuracy:
        gap = accuracy["pserver"] - accuracy["single"]
        # Asynchronous: a push returns before the reducer applies it, so the next pull may miss
        # it and the trainer steps on stale parameters, by how much depends on timing (62.3-67.3%
        # over 23 runs, idle and loaded, single 67.0%; CI saw -3.61).
        check(abs(gap) <= 6, f"pserver: accuracy {accuracy['pserver']:.2f}% within 6 points of "
                             f"single's {accuracy['single']:.2f}% ({gap:+.2f})")
    # ---- ddp as the 2 ranks `torchpar run` starts (RANK/WORLD_SIZE set): no workers of its
    # own, the shards and seeds of --workers 2, hence its accuracy; only rank 0 reports.
    # --no-plot: the outputs but curves.png.
    out = os.path.join(tmp, "run_launched")
    p = subprocess.run([TORCHPAR, "run", "-n", "2", "--", TORCHPAR, "train", "--strategy", "ddp",
                        "--limit", "6000", "--lr", "0.05", "--batch-size", "32", "--no-plot",
                        "--out", out],
                       capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, f"torchpar run -n 2 -- train: exit {p.returncode} {p.stderr.strip()[-300:]}")
    lines = p.stdout.splitlines()
    check(any(l.startswith("[0]: done: test accuracy") for l in lines),
          "torchpar run -n 2 -- train: rank 0 prints the summary")
    check(not any(l.startswith("[1]: ") for l in lines),
          "torchpar run -n 2 -- train: rank 1 prints nothing on stdout")
    if p.returncode == 0:
        m = json.load(open(os.path.join(out, "metrics.json")))
        check(os.path.exists(os.path.join(out, "model.pt")) and
              not os.path.exists(os.path.join(out, "curves.png")),
              "torchpar run -n 2 -- train --no-plot: model.pt written, curves.png not drawn")
        check(m.get("launch") == "environment" and m["workers"] == 2 and m["status"] == "completed",
              f"torchpar run -n 2 -- train: metrics.json says 2 ranks from the environment "
              f"({m.get('launch')}, {m['workers']}, {m['status']})")
        if "ddp" in accuracy:
            got = m["epochs"][0]["test_accuracy"]
            check(abs(got - accuracy["ddp"]) <= 2,
                  f"torchpar run -n 2 -- train: accuracy {got:.2f}% within 2 points of "
                  f"--workers 2's {accuracy['ddp']:.2f}%")

    code, _, err = train("--strategy", "pserver", "--workers", "1", "--out", os.path.join(tmp, "o1"))
    check(code == 2 and "--workers 2 or more" in err, f"pserver with 1 worker: exit {code}: {err.strip()[:160]}")

    # ---- SIGKILL a ddp worker mid-run
    out = os.path.join(tmp, "run_killed")
    code, took, text, workers, victim = kill_mid_run(
        "killed.log", ["--strategy", "ddp", "--workers", "2", "--timeout", "30", "--out", out],
        lambda kids: kids[-1])
    check(len(workers) >= 2, f"ddp run has its workers ({workers})")
    if victim:
        check(code == 1, f"killed worker: the run exits 1 (got {code}) after {took:.1f} s")
        check(f"(pid {victim}) was killed by signal 9" in text,
              "killed worker: the error names the worker: " + text.strip().splitlines()[-1][:200])
        left = left_behind(workers)
        check(not left, f"killed worker: no worker left behind ({left})")
        m = json.load(open(os.path.join(out, "metrics.json")))
        check(m["status"] == "failed" and "worker" in m.get("error", ""), "killed worker: metrics.json says failed")

    # ---- SIGKILL the pserver server (worker 0, the World's rank 0: the first child started)
    out = os.path.join(tmp, "run_server_killed")
    rpc_timeout = 10
    code, took, text, workers, victim = kill_mid_run(
        "server_killed.log", ["--strategy", "pserver", "--workers", "3", "--timeout",
                              str(rpc_timeout), "--out", out],
        lambda kids: kids[0])
    check(len(workers) == 3, f"pserver run has a server and 2 trainers ({workers})")
    if victim:
        check(code == 1 and took < rpc_timeout + 20,
              f"killed server: the run exits 1 (got {code}) after {took:.1f} s (< {rpc_timeout + 20} s)")
        check(f"(parameter server, pid {victim}) was killed by signal 9" in text,
              "killed server: the error names the server: " + text.strip()[-300:])
        for t in workers[1:]:
            line = next((l for l in text.splitlines() if f"(trainer, pid {t}) raised" in l), "")
            check("'server'" in line,
                  f"killed server: trainer {t} failed on its own with an error naming the server: {line[:240]}")
        left = left_behind(workers)
        check(not left, f"killed server: no worker left behind ({left})")
        m = json.load(open(os.path.join(out, "metrics.json")))
        check(m["status"] == "failed" and "parameter server" in m.get("error", ""),
              "killed server: metrics.json says failed, naming the server")
finally:
    shutil.rmtree(tmp, ignore_errors=True)

print("FAILED: " + "; ".join(failures) if failures else "PASSED: torchpar train", flush=True)
sys.exit(1 if failures else 0)
