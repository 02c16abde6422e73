#!/usr/bin/python3
"""`torchpar train` end to end: the data loader on the real files and on a truncated and a
wrong-magic copy; a short run of each strategy (metrics.json fields, accuracy clearly above
chance, model.pt, curves.png); a ddp worker SIGKILLed mid-run ends the run naming it, with no
process left behind.  usage: train_test.py BIN_DIR"""
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

    # ---- a short run of each strategy
    for strategy in ("single", "hogwild", "ddp"):
        out = os.path.join(tmp, "run_" + strategy)
        code, so, err = train("--strategy", strategy, "--workers", "2", "--limit", "6000",
                              "--lr", "0.05", "--batch-size", "32", "--out", out)
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
        check(e["test_accuracy"] > 30, f"{strategy}: accuracy {e['test_accuracy']:.1f}% > 30% (chance 10%)")
        check(os.path.getsize(os.path.join(out, "model.pt")) > 50000, f"{strategy}: model.pt written")
        check(os.path.exists(os.path.join(out, "curves.png")), f"{strategy}: curves.png drawn")
        check("test accuracy" in so, f"{strategy}: prints test accuracy")

    # ---- SIGKILL a ddp worker mid-run
    out = os.path.join(tmp, "run_killed")
    log = open(os.path.join(tmp, "killed.log"), "w+")
    p = subprocess.Popen([TORCHPAR, "train", "--strategy", "ddp", "--workers", "2",
                          "--timeout", "30", "--out", out], stdout=log, stderr=subprocess.STDOUT)
    workers = []
    deadline = time.time() + 60
    while time.time() < deadline:
        log.seek(0)
        if "samples/s" in log.read():  # training is under way
            break
        time.sleep(0.2)
    kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    workers = [int(k) for k in kids]
    check(len(workers) >= 2, f"ddp run has its workers ({workers})")
    if workers:
        os.kill(workers[-1], signal.SIGKILL)
        t0 = time.time()
        try:
            code = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            code = None
        took = time.time() - t0
        log.seek(0)
        text = log.read()
        check(code == 1, f"killed worker: the run exits 1 (got {code}) after {took:.1f} s")
        check(f"(pid {workers[-1]}) was killed by signal 9" in text,
              "killed worker: the error names the worker: " + text.strip().splitlines()[-1][:200])
        time.sleep(0.3)
        left = [w for w in workers if os.path.exists(f"/proc/{w}") and
                open(f"/proc/{w}/stat").read().split()[2] != "Z"]
        check(not left, f"killed worker: no worker left behind ({left})")
        m = json.load(open(os.path.join(out, "metrics.json")))
        check(m["status"] == "failed" and "worker" in m.get("error", ""), "killed worker: metrics.json says failed")
    else:
        p.kill()
finally:
    shutil.rmtree(tmp, ignore_errors=True)

print("FAILED: " + "; ".join(failures) if failures else "PASSED: torchpar train", flush=True)
sys.exit(1 if failures else 0)
