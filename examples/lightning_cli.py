"""LightningCLI with 1-bit Adam chosen in the config: ``trainer.strategy: onebit_adam``.

    python examples/lightning_cli.py fit --config examples/cli_config.yaml
    python examples/lightning_cli.py fit --config examples/cli_config.yaml \\
        --trainer.strategy ddp --model.optimizer adamw                     # DDP + AdamW

The model is the character-level GPT on Python's documentation text; ``import onebit_plugin``
(here, for ``OneBitAdam``) registers the strategy name before the CLI builds the Trainer. Each
rank writes its final parameters and per-step bytes written (``examples/wire.py``) to
``--model.out``, rank 0 a summary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

from onebit_plugin import OneBitAdam

sys.path.insert(0, str(Path(__file__).resolve().parent))
from charlm import CharGPT, evaluate, load_corpus, loss_fn, sample_batch  # noqa: E402
from teardown import leave_process_group  # noqa: E402
from wire import WireLog  # noqa: E402


class CharLM(pl.LightningModule):
    def __init__(self, optimizer: str = "onebit", lr: float = 3e-3, freeze_step: int | str = 60,
                 batch: int = 16, context: int = 64, dim: int = 64, layers: int = 2,
                 seed: int = 0, out: str = "cli_out"):
        super().__init__()
        self.save_hyperparameters()
        self.model = CharGPT(dim=dim, layers=layers, context=context)
        self.train_data, self.val_data = load_corpus()
        self.wire = WireLog()

    def train_dataloader(self):
        # Only the epoch's length: batches are a function of (seed, rank, step) below.
        return DataLoader(range(self.trainer.max_steps), batch_size=1)

    def training_step(self, batch, batch_idx):
        h = self.hparams
        gen = torch.Generator().manual_seed(
            (h.seed * 1009 + self.global_rank) * 1_000_003 + self.global_step)
        x, y = (t.to(self.device) for t in sample_batch(self.train_data, h.batch, h.context, gen))
        return loss_fn(self.model, x, y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.wire.mark(self.global_step)

    def configure_optimizers(self):
        h = self.hparams
        if h.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=h.lr, weight_decay=0.01)
        return OneBitAdam(self.parameters(), lr=h.lr, weight_decay=0.01,
                          decoupled_weight_decay=True, freeze_step=h.freeze_step)

    def on_fit_end(self):
        out = Path(self.hparams.out)
        out.mkdir(parents=True, exist_ok=True)
        rank = self.global_rank
        self.wire.save(out / f"wire.rank{rank}.json")
        torch.save([p.detach().cpu() for p in self.parameters()], out / f"params.rank{rank}.pt")
        if rank == 0:
            opt = self.trainer.optimizers[0]
            summary = {"optimizer": type(opt).__name__, "steps": self.global_step,
                       "strategy": type(self.trainer.strategy).__name__,
                       "switch_step": getattr(opt, "switch_step", None),
                       "val_loss": evaluate(self.model, self.val_data.to(self.device),
                                            self.hparams.context)}
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            print(json.dumps(summary))


if __name__ == "__main__":
    LightningCLI(CharLM, save_config_callback=None)
    leave_process_group()  # gloo's exit race: teardown.py
