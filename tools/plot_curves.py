#!/usr/bin/python3
"""Draws curves.png from a `torchpar train` metrics.json: train/test loss and test accuracy
per epoch. usage: plot_curves.py metrics.json curves.png (needs python3-matplotlib)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    with open(src) as f:
        m = json.load(f)
    ep = [e["epoch"] for e in m["epochs"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(ep, [e["train_loss"] for e in m["epochs"]], "o-", label="train loss")
    a.plot(ep, [e["test_loss"] for e in m["epochs"]], "s-", label="test loss")
    a.set_xlabel("epoch")
    a.set_ylabel("NLL loss")
    a.legend()
    b.plot(ep, [e["test_accuracy"] for e in m["epochs"]], "o-", color="tab:green")
    b.set_xlabel("epoch")
    b.set_ylabel("test accuracy (%)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.set_xticks(ep)
    fig.suptitle(f"torchpar train --strategy {m['strategy']} --workers {m['workers']}: "
                 f"{m['samples_per_s']:.0f} samples/s")
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
