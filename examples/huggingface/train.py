"""train_plain.py with TrainMover's callback: 2 lines added (tests/unit/test_trainers.py).

    trainmover run examples/huggingface/train.py --epochs 3                  # in a Slurm job
    torchrun --nproc-per-node=2 examples/huggingface/train.py --epochs 3     # still runs as before
"""
import argparse
import json

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from trainmover.integrations.huggingface import TrainMoverCallback


class Tokens(Dataset):
    """Sequences from a small Markov chain over the vocabulary: a language a model can learn."""

    def __init__(self, seed: int, n: int, length: int = 16, vocab: int = 64):
        g = torch.Generator().manual_seed(seed)
        step = torch.randint(1, 4, (n, length), generator=g)
        self.ids = (torch.randint(0, vocab, (n, 1), generator=g) + step.cumsum(1)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--outdir", default="hf-out")
    p.add_argument("--out", default="")
    args = p.parse_args()

    set_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    targs = TrainingArguments(output_dir=args.outdir, num_train_epochs=args.epochs, per_device_train_batch_size=4,
                              gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="cosine",
                              warmup_steps=4, logging_steps=1, eval_strategy="epoch", save_strategy="epoch",
                              use_cpu=True, ddp_backend="gloo", report_to="none", disable_tqdm=True, seed=args.seed)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(args.seed, 64),
                      eval_dataset=Tokens(args.seed + 1, 16), callbacks=[TrainMoverCallback()])
    trainer.train()
    if trainer.is_world_process_zero() and args.out:
        torch.save(model.state_dict(), args.out)
        with open(args.out + ".log.json", "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
