#!/usr/bin/env python3
"""The outside reference for torchpar's Gpt: a plain torch.nn GPT-2 (pre-LayerNorm blocks, fused
QKV, tanh-GELU MLP, tied embedding head), seeded, that writes its weights and its logits for a
fixed input. tests/parallel/tensor_parallel_test.cpp runs it and checks that torchpar's Gpt,
loaded with the same weights, computes the same logits at TP = 1 and TP = 2.

Names and layouts are Hugging Face's GPT-2 ones without the "transformer." prefix (wte, wpe,
h.<i>.ln_1, h.<i>.attn.c_attn, ...); the projections are Conv1D-style (weight [in, out], as
GPT-2's checkpoints store them), so torchpar's policy slices them with transposed = true.
Every bias and LayerNorm parameter is random, so a bias added twice (or not at all) shows.

Usage: gpt_reference.py --out DIR [--layers N --width C --heads H --vocab V --context P
                                  --batch B --tokens T --seed S]
Writes (torch.save, zip format, a plain dict each):
  DIR/state_dict.pt  name -> float32 tensor, contiguous
  DIR/reference.pt   "input_ids" int64 [B, T], "logits" float32 [B, T, V]
"""
import argparse
import math
import os

import torch
from torch import nn
from torch.nn import functional as F


class Conv1D(nn.Module):
    """x @ weight + bias with weight [in, out] (GPT-2's transformers.pytorch_utils.Conv1D)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.02)

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.weight.size(1))


def layer_norm(width):
    ln = nn.LayerNorm(width, eps=1e-5)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.1 * torch.randn(width))
        ln.bias.copy_(0.1 * torch.randn(width))
    return ln


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = Conv1D(width, 3 * width)
        self.c_proj = Conv1D(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        y = (probs @ v).transpose(1, 2).reshape(b, t, c)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc = Conv1D(width, 4 * width)
        self.c_proj = Conv1D(4 * width, width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = layer_norm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = layer_norm(width)
        self.mlp = Mlp(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, layers, width, heads, vocab, context):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        with torch.no_grad():
            self.wte.weight.normal_(0, 0.02)
            self.wpe.weight.normal_(0, 0.01)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = layer_norm(width)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.size(1))
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head: no parameter of its own


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=101)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=11)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    model = Gpt(a.layers, a.width, a.heads, a.vocab, a.context).eval()
    input_ids = torch.randint(a.vocab, (a.batch, a.tokens), dtype=torch.int64)
    with torch.no_grad():
        logits = model(input_ids)

    os.makedirs(a.out, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    torch.save(state, os.path.join(a.out, "state_dict.pt"))
    torch.save({"input_ids": input_ids, "logits": logits.contiguous()},
               os.path.join(a.out, "reference.pt"))
    print(f"wrote {len(state)} tensors, logits {tuple(logits.shape)} to {a.out}")


if __name__ == "__main__":
    main()
