#!/usr/bin/python3
"""Draws curves.png from a `torchpar train` metrics.json. mnist: train/test loss and test
accuracy per epoch; gpt: train/validation loss per evaluation with the unigram baseline, and
the validation perplexity. usage: plot_curves.py metrics.json curves.png (needs
python3-matplotlib)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def mnist(m, a, b):
    ep = [e["epoch"] for e in m["epochs"]]
    a.plot(ep, [e["train_loss"] for e in m["epochs"]], "o-", label="train loss")
    a.plot(ep, [e["test_loss"] for e in m["epochs"]], "s-", label="test loss")
    a.set_xlabel("epoch")
    a.set_ylabel("NLL loss")
    b.plot(ep, [e["test_accuracy"] for e in m["epochs"]], "o-", color="tab:green")
    b.set_xlabel("epoch")
    b.set_ylabel("test accuracy (%)")
    for ax in (a, b):
        ax.set_xticks(ep)
    return (f"torchpar train --strategy {m['strategy']} --workers {m['workers']}: "
            f"{m['samples_per_s']:.0f} samples/s")


def gpt(m, a, b):
    st = [e["step"] for e in m["evals"]]
    a.plot(st, [e["train_loss"] for e in m["evals"]], "o-", label="train loss")
    a.plot(st, [e["val_loss"] for e in m["evals"]], "s-", label="validation loss")
    a.axhline(m["unigram_baseline_loss"], color="gray", linestyle="--",
              label="unigram baseline")
    a.set_xlabel("step")
    a.set_ylabel("loss (nats per byte)")
    b.plot(st, [e["val_perplexity"] for e in m["evals"]], "o-", color="tab:green")
    b.set_xlabel("step")
    b.set_ylabel("validation perplexity (per byte)")
    c = m["config"]
    return (f"torchpar train --model gpt --strategy {m['strategy']} --workers {m['workers']} "
            f"({c['n_layer']} layers, width {c['n_embd']}): {m['tokens_per_s']:.0f} tokens/s")


def main(src, dst):
    with open(src) as f:
        m = json.load(f)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    title = gpt(m, a, b) if m.get("model") == "gpt" else mnist(m, a, b)
    a.legend()
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
