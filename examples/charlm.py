"""A small character-level GPT on a real offline corpus: the documentation topics that ship with
Python itself (``pydoc_data.topics``, about 465 KB of English text and code).

Tokens are UTF-8 bytes (vocabulary 256), so most embedding rows never see a gradient -- the case
where a plain 1-bit Adam diverges (docs/design.md, "Masks").
"""

from __future__ import annotations

import math

import torch
from torch import nn


def load_corpus(val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation splits of the corpus as uint8 byte tensors (deterministic)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    split = int(len(data) * (1 - val_fraction))
    return data[:split], data[split:]


def sample_batch(data: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
    offsets = torch.arange(context + 1)
    chunk = data[starts[:, None] + offsets].long()
    return chunk[:, :-1], chunk[:, 1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """GPT-style decoder: token + position embeddings, pre-norm blocks, a linear output head.

    The head is not tied to the embedding, so embedding rows of bytes that never occur get no
    gradient at all and keep a zero Adam variance.
    """

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4,
                 context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        # Made here, not kept as a buffer: DDP broadcasts every buffer from rank 0 at each
        # forward, uncompressed (16 KB per step for a 64-token mask, as much as this model's
        # whole 1-bit momentum exchange).
        causal = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        for block in self.blocks:
            x = block(x, causal)
        return self.head(self.ln(x))


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, context: int, batches: int = 8,
             batch: int = 32) -> float:
    """Mean loss on fixed validation batches (the same on every rank and every call)."""
    gen = torch.Generator().manual_seed(1234)
    was_training = model.training
    model.eval()
    total = sum(loss_fn(model, *sample_batch(data, batch, context, gen)).item()
                for _ in range(batches))
    model.train(was_training)
    return total / batches


def bits_per_byte(loss: float) -> float:
    return loss / math.log(2)


def freeze_step_arg(value: str) -> int | str:
    """``--freeze-step``: an int, or ``auto`` (OneBitAdam decides, at most at 20% of the run)."""
    return value if value == "auto" else int(value)
