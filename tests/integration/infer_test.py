#!/usr/bin/python3
"""`torchpar infer` end to end on a checkpoint written by Python: a plain torch.nn GPT-2
(tests/parallel/gpt_reference.py; byte-level, 256 tokens) saved with torch.save plus a
model.json. Greedy text at --tensor-parallel 1 and 2 equals Python's own greedy continuation
(decoded with errors="replace"); seeded sampling repeats and agrees across TP sizes; bfloat16
runs; float16, a prompt that does not fit and a missing model.json end with exit code 1 and a
message naming the cause. Without python3-torch too: a model.json that is a FIFO, /dev/zero or
too large, or holds sizes no int64 holds (1e30), and options that are NaN, infinite, too large
for a deadline (--timeout 1e10) or out of range (--seed) are refused within seconds; then exit
77 (skipped) when python3-torch is missing.
usage: infer_test.py BIN_DIR"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

BIN = sys.argv[1]
TORCHPAR = os.path.join(BIN, "torchpar")
PROMPT = "Tensor parallel, byte by byte: "
NEW = 48
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def infer(model, *args, timeout=180):
    p = subprocess.run([TORCHPAR, "infer", "--model", model, "--prompt", PROMPT, *args],
                       capture_output=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr.decode("utf-8", "replace")


def refused(model, args, says, what):
    """`torchpar infer` exits non-zero within 30 s, its stderr naming `says`."""
    try:
        code, _, err = infer(model, *args, timeout=30)
    except subprocess.TimeoutExpired:
        check(False, f"{what}: refused within 30 s (still running: killed)")
        return
    check(code != 0 and says in err, f"{what}: exit {code}, stderr says {says!r} ({err.strip()[-300:]})")


# ---- refused before any worker starts (no python3-torch needed)
tmp = tempfile.mkdtemp(prefix="torchpar_infer_refused_")
try:
    fake = os.path.join(tmp, "model.pt")  # never read: each case is refused first
    with open(fake, "wb") as f:
        f.write(b"not a checkpoint")
    sidecar = os.path.join(tmp, "model.json")
    good = {"vocab_size": 256, "n_positions": 128, "n_embd": 64, "n_layer": 2, "n_head": 4}
    for key, value in (("n_embd", "1e30"), ("n_head", "4.5"), ("vocab_size", "-1"),
                       ("n_positions", "18446744073709551616")):
        with open(sidecar, "w") as f:
            f.write(json.dumps(good).replace(f'"{key}": {good[key]}', f'"{key}": {value}'))
        refused(fake, [], f'"{key}"', f"model.json with {key} {value}")
    os.remove(sidecar)
    os.mkfifo(sidecar)
    refused(fake, ["--timeout", "5"], "not a regular file", "model.json a FIFO")
    os.remove(sidecar)
    os.symlink("/dev/zero", sidecar)
    refused(fake, ["--timeout", "5"], "not a regular file", "model.json -> /dev/zero")
    os.remove(sidecar)
    with open(sidecar, "w") as f:
        f.write(" " * (2 << 20) + json.dumps(good))
    refused(fake, [], "more than the", "a 2 MiB model.json")
    with open(sidecar, "w") as f:
        json.dump(good, f)
    for args, says in ((["--timeout", "nan"], "--timeout"), (["--timeout", "inf"], "--timeout"),
                       (["--timeout", "1e10"], "--timeout"), (["--temperature", "nan"], "--temperature"),
                       (["--seed", "18446744073709551616"], "--seed"), (["--seed", "-1"], "--seed")):
        refused(fake, args, says, " ".join(args))
finally:
    shutil.rmtree(tmp, ignore_errors=True)

try:
    import torch
except ImportError:
    print(f"{len(failures)} failure(s) in the refusals")
    print("skip: /usr/bin/python3 has no torch (Debian: python3-torch)")
    sys.exit(1 if failures else 77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "parallel"))
import gpt_reference  # noqa: E402

tmp = tempfile.mkdtemp(prefix="torchpar_infer_")
try:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = gpt_reference.Gpt(layers=2, width=64, heads=4, vocab=256, context=128).eval()
    path = os.path.join(tmp, "model.pt")
    torch.save({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, path)
    with open(os.path.join(tmp, "model.json"), "w") as f:
        json.dump({"vocab_size": 256, "n_positions": 128, "n_embd": 64, "n_layer": 2,
                   "n_head": 4, "dtype": "float32", "tokenizer": "bytes",
                   "weight_layout": "conv1d"}, f)

    ids = torch.tensor([list(PROMPT.encode())], dtype=torch.int64)
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    want = (bytes(ids[0].tolist()).decode("utf-8", "replace") + "\n").encode()

    for tp in (1, 2):
        code, out, err = infer(path, "--tensor-parallel", str(tp), "--greedy",
                               "--max-new-tokens", str(NEW))
        check(code == 0, f"TP={tp} greedy: exit 0 ({code}: {err.strip()[-300:]})")
        check(out == want, f"TP={tp} greedy: the text equals Python's greedy continuation\n"
                           f"  got  {out!r}\n  want {want!r}")
        check("tokens/s" in err, f"TP={tp}: tokens/s on stderr ({err.strip()[-200:]})")
        try:
            out.decode("utf-8")
            check(True, f"TP={tp}: stdout is valid UTF-8")
        except UnicodeDecodeError as e:
            check(False, f"TP={tp}: stdout is valid UTF-8 ({e})")

    sampled = ("--seed", "5", "--temperature", "0.9", "--top-k", "20", "--max-new-tokens", "40")
    # Two runs, TP=2 then TP=1: equal texts prove both the seed's reproducibility and that
    # the world size does not change the draws (an unseeded sampler would differ).
    runs = [infer(path, "--tensor-parallel", str(tp), *sampled) for tp in (2, 1)]
    check(all(r[0] == 0 for r in runs), "sampled runs exit 0")
    check(runs[0][1] == runs[1][1], "the same --seed gives the same text at TP=1 and TP=2")
    check("seed 5" in runs[0][2], "the seed is reported on stderr")

    code, out, err = infer(path, "--tensor-parallel", "2", "--dtype", "bfloat16",
                           "--max-new-tokens", "16")
    check(code == 0 and out.startswith(PROMPT.encode()), f"bfloat16 runs ({code}: {err[-300:]})")

    code, out, err = infer(path, "--tensor-parallel", "2", "--dtype", "float16")
    check(code == 0 or "float16" in err, f"float16: runs, or is refused naming it ({err[-300:]})")

    code, out, err = infer(path, "--max-new-tokens", "120")
    check(code == 1 and "n_positions" in err, f"a prompt that does not fit ({code}: {err[-300:]})")

    other = os.path.join(tmp, "other.pt")
    shutil.copy(path, other)
    code, out, err = infer(other)
    check(code == 1 and "other.json" in err, f"a missing model.json ({code}: {err[-300:]})")

    code, out, err = infer(path, "--tensor-parallel", "3")
    check(code == 1 and "world size 3" in err, f"heads that do not split ({code}: {err[-300:]})")
finally:
    shutil.rmtree(tmp, ignore_errors=True)

print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
