"""train_plain.py ported to TrainMover: 6 lines changed (tests/unit/test_script_examples.py).

    trainmover run examples/scripts/train_tm.py --epochs 3                 # in a Slurm job
    torchrun --nproc-per-node=2 examples/scripts/train_tm.py --epochs 3    # still runs as before
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import trainmover.script as tm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(seed: int, n: int = 256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default="")
    args = p.parse_args()

    tm.init("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    ddp = DDP(model)
    ds = make_data(args.seed)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader))

    tm.track(model=model, optimizer=opt, scheduler=sched)
    for epoch in tm.loop(range(args.epochs)):
        sampler.set_epoch(epoch)
        for i, (x, y) in tm.enumerate(loader):
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tm.step(loss)
            if rank == 0 and i % 10 == 0:
                print(f"epoch {epoch} step {i} loss {loss.item():.4f}", flush=True)

    if rank == 0 and args.out:
        torch.save(model.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
