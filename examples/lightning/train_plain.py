"""A Lightning script as Lightning's docs write one (no TrainMover): DDP on the CPU, bf16,
gradient accumulation, clipping, OneCycle, dropout, a shuffling loader, a CSVLogger.

    torchrun --nproc-per-node=2 examples/lightning/train_plain.py --epochs 3

train.py is the same script with TrainMover's callback (2 lines; tests/unit/test_trainers.py).
"""
import argparse
import os

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset


def make_data(seed: int, n: int = 256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    return TensorDataset(x, (x @ w).argmax(dim=1))


class Net(L.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr,
                                                    total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--logdir", default="logs")
    p.add_argument("--out", default="")
    args = p.parse_args()

    L.seed_everything(args.seed)
    loader = DataLoader(make_data(args.seed), batch_size=args.batch, shuffle=True)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=devices,
                        num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // devices, max_epochs=args.epochs,
                        precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=1.0,
                        logger=CSVLogger(args.logdir), log_every_n_steps=1, enable_progress_bar=False)
    model = Net(args.lr)
    trainer.fit(model, loader)
    if trainer.global_rank == 0 and args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
