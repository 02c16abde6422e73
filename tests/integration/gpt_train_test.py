#!/usr/bin/python3
"""`torchpar train --model gpt` end to end on a slice of the fortunes corpus: missing and empty
data directories and options of the other model are refused (exit 2, before --out exists); a
small model trained with ddp on 2 workers ends clearly below the unigram baseline, with
metrics.json, curves.png, model.json and a model.pt that Python's torch.load reads into the
reference GPT-2 of tests/parallel/gpt_reference.py, which scores the held-out windows as the run
did; a single-process run; SIGINT keeps the finished evaluations and leaves no worker behind.
usage: gpt_train_test.py BIN_DIR"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BIN = sys.argv[1]
TORCHPAR = os.path.join(BIN, "torchpar")
HERE = os.path.dirname(os.path.abspath(__file__))
DATA = "/usr/share/games/fortunes"
LIMIT = 200000  # bytes of the corpus: about 930 fortunes, 8 KB of them held out
# A model small enough for a few seconds of training on 2 cores.
SMALL = ["--layers", "2", "--width", "64", "--heads", "2", "--context", "64", "--batch-size", "8",
         "--lr", "3e-3", "--limit", str(LIMIT)]
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def train(*args, timeout=600):
    p = subprocess.run([TORCHPAR, "train", "--model", "gpt", *args], capture_output=True,
                       text=True, errors="replace", timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def fortune_splits(data_dir, limit):
    """The training and held-out bytes as fortunes.cpp makes them (the reference for the
    held-out windows below): every 20th fortune is held out, each followed by "%\\n"."""
    names = sorted(n for n in os.listdir(data_dir)
                   if not n.startswith(".") and not n.endswith((".dat", ".u8")))
    files = [os.path.join(data_dir, n) for n in names]
    files = [f for f in files if os.path.isfile(f) and not os.path.islink(f)]
    text, fortunes = b"", []
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read(limit - len(text) if limit else -1)
        text += data
        start, pos = 0, 0
        while pos < len(data):
            eol = data.find(b"\n", pos)
            nxt = len(data) if eol < 0 else eol + 1
            line = data[pos:len(data) if eol < 0 else eol]
            if line.endswith(b"\r"):
                line = line[:-1]
            if line == b"%":
                fortunes.append(data[start:pos])
                start = nxt
            pos = nxt
        fortunes.append(data[start:])
        if limit and len(text) >= limit:
            break
    fortunes = [f for f in fortunes if not f.isspace() and f]
    train_b, val_b = bytearray(), bytearray()
    for i, f in enumerate(fortunes):
        split = val_b if i % 20 == 19 else train_b
        split += f if f.endswith(b"\n") else f + b"\n"
        split += b"%\n"
    return bytes(train_b), bytes(val_b), len(fortunes)


def check_checkpoint(out, metrics):
    """model.pt through Python's torch.load into the reference model; its loss on the held-out
    windows equals the run's last val_loss."""
    try:
        import torch
        from torch.nn import functional as F
    except ImportError:
        print("skip model.pt checks: /usr/bin/python3 has no torch (python3-torch)")
        return
    sys.dont_write_bytecode = True  # nothing written into the source tree
    sys.path.insert(0, os.path.join(HERE, "..", "parallel"))
    import gpt_reference

    cfg = json.load(open(os.path.join(out, "model.json")))
    want = {"vocab_size": 256, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 2,
            "n_inner": 256, "dtype": "float32", "tokenizer": "bytes"}
    check(all(cfg.get(k) == v for k, v in want.items()), f"model.json: {cfg}")
    sd = torch.load(os.path.join(out, "model.pt"))
    check(type(sd) is dict and len(sd) == 4 + 12 * 2, f"model.pt: a dict of 28 tensors ({len(sd)})")
    shapes = {"wte.weight": (256, 64), "wpe.weight": (64, 64), "ln_f.bias": (64,),
              "h.0.attn.c_attn.weight": (64, 192), "h.1.attn.c_proj.weight": (64, 64),
              "h.1.mlp.c_fc.weight": (64, 256), "h.1.mlp.c_proj.weight": (256, 64)}
    bad = {k: tuple(sd[k].shape) for k in shapes if k not in sd or tuple(sd[k].shape) != shapes[k]}
    check(not bad, f"model.pt: GPT-2 names, Conv1D [in, out] layout ({bad or 'as expected'})")

    model = gpt_reference.Gpt(cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["vocab_size"],
                              cfg["n_positions"]).eval()
    model.load_state_dict(sd, strict=True)
    _, val, _ = fortune_splits(DATA, LIMIT)
    c = cfg["n_positions"]
    v = torch.frombuffer(bytearray(val), dtype=torch.uint8).long()
    n = min(64, max(1, (len(v) - 1) // c))
    first = torch.linspace(0, len(v) - c - 1, n, dtype=torch.float64).floor().long()
    w = v[first.unsqueeze(1) + torch.arange(c + 1)]
    with torch.no_grad():
        logits = model(w[:, :c])
        loss = F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1)).item()
    check(abs(loss - metrics["val_loss"]) < 2e-3,
          f"model.pt in Python scores the held-out windows {loss:.4f}, the run {metrics['val_loss']:.4f}")


def check_infer(out):
    """train then infer: `torchpar infer` continues a prompt with the run's model.pt +
    model.json, greedily, at TP = 1 and TP = 2 (2 worker processes), the same text both times."""
    model = os.path.join(out, "model.pt")
    prompt = "The meaning of life is"
    texts = {}
    for n in (1, 2):
        p = subprocess.run([TORCHPAR, "infer", "--model", model, "--prompt", prompt, "--greedy",
                            "--max-new-tokens", "16", "--tensor-parallel", str(n)],
                           capture_output=True, timeout=300)
        err = p.stderr.decode(errors="replace")
        check(p.returncode == 0, f"infer --tensor-parallel {n}: exit {p.returncode}: {err[-300:]}")
        text = p.stdout.decode(errors="replace")
        check(text.startswith(prompt) and len(text.encode()) > len(prompt),
              f"infer --tensor-parallel {n}: continues the prompt: {text[:80]!r}")
        check("tokens/s" in err, f"infer --tensor-parallel {n}: reports tokens/s: {err[-200:]}")
        texts[n] = text
    check(texts[1] == texts[2], f"greedy text at TP = 1 and TP = 2 equal: {texts[1]!r} vs {texts[2]!r}")


tmp = tempfile.mkdtemp(prefix="torchpar_gpt_train_test_")
try:
    # ---- refused before anything is written
    out = os.path.join(tmp, "out_missing")
    code, _, err = train("--data", os.path.join(tmp, "nowhere"), "--out", out)
    check(code == 2 and "nowhere" in err and "install-deps" in err and "fortunes" in err,
          f"missing data dir: exit {code}: {err.strip()[:200]}")
    check(not os.path.exists(out), "missing data dir: --out not created")

    empty = os.path.join(tmp, "empty")
    os.makedirs(os.path.join(empty, "off"))
    open(os.path.join(empty, "cookie.dat"), "wb").write(b"\0\0\0\2")
    os.symlink(os.path.join(DATA, "cookie"), os.path.join(empty, "cookie.u8"))
    open(os.path.join(empty, "off", "cookie"), "w").write("not read\n%\n")
    open(os.path.join(empty, "blank"), "w").write("\n%\n  \n%\n")
    out = os.path.join(tmp, "out_empty")
    code, _, err = train("--data", empty, "--out", out)
    check(code == 2 and "no fortunes" in err and empty in err,
          f"no fortune files (only .dat, .u8, off/, blank fortunes): exit {code}: {err.strip()[:200]}")
    check(not os.path.exists(out), "empty data dir: --out not created")

    for args, says in ((["--strategy", "hogwild"], "single or ddp"),
                       (["--strategy", "pserver"], "single or ddp"),
                       (["--epochs", "2"], "--epochs applies to --model mnist"),
                       (["--heads", "3"], "divisible"),
                       (["--limit", "1000"], "too little text")):
        code, _, err = train(*args, "--out", os.path.join(tmp, "o_refused"))
        check(code == 2 and says in err, f"{' '.join(args)}: exit {code}: {err.strip()[:200]}")
    p = subprocess.run([TORCHPAR, "train", "--model", "mnist", "--steps", "5", "--out",
                        os.path.join(tmp, "o_refused")], capture_output=True, text=True)
    check(p.returncode == 2 and "--steps applies to --model gpt" in p.stderr,
          f"--steps with mnist: exit {p.returncode}: {p.stderr.strip()[:200]}")
    check(not os.path.exists(os.path.join(tmp, "o_refused")), "refused options: --out not created")

    # ---- ddp, 2 workers: clearly below the unigram baseline; the outputs
    out = os.path.join(tmp, "run_ddp")
    t0 = time.time()
    code, so, err = train("--strategy", "ddp", "--workers", "2", *SMALL, "--steps", "150",
                          "--eval-every", "50", "--out", out)
    print(f"ddp run: {time.time() - t0:.1f} s")
    check(code == 0, f"ddp: exit {code} {err.strip()[-400:]}")
    if code == 0:
        m = json.load(open(os.path.join(out, "metrics.json")))
        fields = {"model", "strategy", "workers", "config", "parameters", "evals", "val_loss",
                  "val_perplexity", "unigram_baseline_loss", "unigram_val_loss", "tokens_per_s",
                  "samples_per_s", "sample", "status", "corpus", "optimizer", "versions"}
        check(fields <= set(m), f"metrics.json has {sorted(fields - set(m))} missing")
        check(m["model"] == "gpt" and m["strategy"] == "ddp" and m["workers"] == 2 and
              m["status"] == "completed", "metrics.json: gpt, ddp, 2 workers, completed")
        check([e["step"] for e in m["evals"]] == [50, 100, 150], f"evaluations at steps 50, 100, 150")
        e = m["evals"][-1]
        check({"step", "train_loss", "val_loss", "val_perplexity", "seconds", "tokens",
               "tokens_per_s"} <= set(e), "per-evaluation fields")
        check(abs(e["val_perplexity"] - math.exp(e["val_loss"])) < 1e-6 * e["val_perplexity"],
              "perplexity = exp(val loss)")
        check(e["tokens"] == 50 * 2 * 8 * 64, f"tokens of a round: 50 steps x 2 workers x 8 x 64 ({e['tokens']})")
        base = m["unigram_baseline_loss"]
        train_b, val_b, fortunes = fortune_splits(DATA, LIMIT)
        check(m["corpus"]["train_bytes"] == len(train_b) and m["corpus"]["val_bytes"] == len(val_b)
              and m["corpus"]["fortunes"] == fortunes,
              f"corpus split as fortunes.cpp documents it ({m['corpus']})")
        check(2.5 < base < 4.5, f"unigram baseline {base:.4f} nats/byte (English bytes: 3 to 4)")
        check(m["val_loss"] < base - 0.3,
              f"validation loss {m['val_loss']:.4f} clearly below the unigram baseline {base:.4f}")
        check(m["evals"][0]["val_loss"] > m["val_loss"], "validation loss falls")
        check(m["tokens_per_s"] > 0, f"{m['tokens_per_s']:.0f} tokens/s")
        s = m["sample"]
        check(s["bytes"] == 200 and s["prompt"] and s["text"], f"sample: {s['text'][:60]!r}")
        check(s["prompt"] in so and "val loss" in so and "tokens/s" in so and "done:" in so,
              "prints the evaluations, the sample and the closing line")
        check(os.path.exists(os.path.join(out, "curves.png")), "curves.png drawn")
        check_checkpoint(out, m)
        check_infer(out)

    # ---- single: the same model in one process
    out = os.path.join(tmp, "run_single")
    code, so, err = train("--strategy", "single", *SMALL, "--steps", "20", "--no-plot",
                          "--out", out)
    check(code == 0, f"single: exit {code} {err.strip()[-400:]}")
    if code == 0:
        m = json.load(open(os.path.join(out, "metrics.json")))
        check(m["strategy"] == "single" and m["workers"] == 1 and len(m["evals"]) == 10,
              "single: 1 worker, an evaluation every 2 of 20 steps")
        check(os.path.getsize(os.path.join(out, "model.pt")) > 100000, "single: model.pt written")

    # ---- SIGINT after the first evaluation: exit 130, finished evaluations and model kept
    out = os.path.join(tmp, "run_interrupted")
    log = open(os.path.join(tmp, "interrupted.log"), "w+")
    p = subprocess.Popen([TORCHPAR, "train", "--model", "gpt", "--workers", "2", *SMALL,
                          "--steps", "100000", "--eval-every", "20", "--no-plot", "--out", out],
                         stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        log.seek(0)
        if "val loss" in log.read():
            break
        time.sleep(0.2)
    kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                          text=True).stdout.split()
    p.send_signal(signal.SIGINT)
    try:
        code = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        code = None
    check(code == 130, f"SIGINT: exit {code}")
    time.sleep(0.3)
    left = [k for k in kids if os.path.exists(f"/proc/{k}") and
            open(f"/proc/{k}/stat").read().split()[2] != "Z"]
    check(len(kids) >= 2 and not left, f"SIGINT: workers {kids}, none left behind ({left})")
    if os.path.exists(os.path.join(out, "metrics.json")):
        m = json.load(open(os.path.join(out, "metrics.json")))
        check(m["status"] == "interrupted" and len(m["evals"]) >= 1 and "sample" not in m,
              f"SIGINT: metrics.json says interrupted, keeps {len(m['evals'])} evaluation(s)")
        check(os.path.exists(os.path.join(out, "model.pt")), "SIGINT: model.pt kept")
    else:
        check(False, "SIGINT: metrics.json written")
finally:
    shutil.rmtree(tmp, ignore_errors=True)

print("FAILED: " + "; ".join(failures) if failures else "PASSED: torchpar train --model gpt",
      flush=True)
sys.exit(1 if failures else 0)
