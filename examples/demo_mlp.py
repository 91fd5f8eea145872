"""A small MLP whose hidden layers are TTLinear, trained on a synthetic
regression task; prints the loss and the compression as it goes.

    python examples/demo_mlp.py
"""
import time

import torch
from torch import nn

import comera


def main(steps: int = 300, seed: int = 0):
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 64))
    model = nn.Sequential(comera.TTLinear(256, 512, rank=16), nn.Tanh(),
                          comera.TTLinear(512, 64, rank=16))
    dense_params = 256 * 512 + 512 * 64
    tt_params = sum(m.tt_params() for m in model if isinstance(m, comera.TTLinear))
    print(model)
    print(f"dense weights {dense_params:,} -> TT cores {tt_params:,} "
          f"({dense_params / tt_params:.1f}x compression)")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x_val = torch.randn(1024, 256)
    y_val = teacher(x_val).detach()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(256, 256)
        loss = nn.functional.mse_loss(model(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == 1:
            with torch.no_grad():
                val = nn.functional.mse_loss(model(x_val), y_val).item()
            print(f"step {step:4d}  train loss {loss.item():.4f}  val loss {val:.4f}")
    print(f"done in {time.perf_counter() - t0:.1f}s; baseline (predict zero) loss "
          f"{y_val.pow(2).mean().item():.4f}")


if __name__ == "__main__":
    main()
