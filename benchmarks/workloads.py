"""The accuracy benchmarks' workloads (``benchmarks/fidelity.py`` and the scripts that import its
``WORKLOADS``): small models on offline data, each small enough for 2 CPU cores.

A workload gives ``lr`` and ``batch`` (per rank), ``model()``, ``batch_of(gen)`` (this rank's
batch from its own generator), ``loss(model, batch)``, ``val_loss(model)`` and, optionally,
``schedule(step, steps)`` (the learning rate's factor at a 0-based step, stepped by the caller).

The standard three (``make fidelity``):

* ``gpt_text``: the char-level GPT of ``examples/charlm.py`` on Python's own documentation text;
* ``word_embed``: a word-level next-word model over the same text (4,096-word vocabulary, Zipf
  distributed, so most embedding rows are rare; 85% of the parameters are embeddings);
* ``digits``: an MLP on scikit-learn's bundled ``digits`` images (1,797 8x8 images, 10 classes);

1-bit LAMB's ``large_batch``: the word-level model at a global batch of 4,096 (2,048 per rank),
LAMB's learning rate scaled from the small-batch one by sqrt(4096 / 128), as LAMB's users scale
it. And the ``wider`` three, kinds the standard ones do not cover (issue 44: 0/1 Adam's defaults,
chosen on the standard three, ended 5.9% above Adam on a model of another kind):

* ``char_mlp``: the issue's model, a character-level language model that is an MLP over
  embeddings: a 48-wide embedding of a 32-byte context, flattened (1,536) -> 512 -> 512 -> 256
  bytes, GELU, on the documentation text; constant learning rate 2e-3, batch 32 per rank. No
  attention, no layer norm: most parameters are two dense matrices.
* ``gpt_cosine``: the ``gpt_text`` transformer under the schedule transformer users run, a
  linear warm-up over the first 5% of steps to 3e-3, then a cosine decay to 10% of it at the
  last step. The optimizer's learning rate moves every step, in both stages.
* ``bow_topics``: a bag-of-words classifier with gradients sparse in rows: which of 16 standard
  library packages a 64-token window of its source code comes from, identifiers hashed into
  16,384 embedding rows (averaged by ``nn.EmbeddingBag``), then 64 -> 64 -> 16. 94% of the
  parameters are embedding rows, of which a batch touches a few hundred.

And the ``tail`` two (issue 59), embedding tables whose rows are drawn from long-tailed laws, so
that a row of the tail gets its first gradient late (after a freeze at 20% of the run) and few
of them:

* ``recsys_zipf``: a neural-collaborative-filtering recommender on synthetic ratings: 40,000
  users and 8,000 items drawn from Zipf laws (exponents 1.05 and 0.9, the heavy ids scattered
  by a fixed permutation), a 32-wide embedding each, an MLP over ``[u, i, u * i]`` (96 -> 128
  -> 1), mean squared error against the ratings of a fixed hidden rank-8 model plus noise;
  constant learning rate 3e-3, batch 256 per rank (the issue's workload, measured from outside
  there).
* ``code_words``: a next-token language model over the standard library's source (16 packages,
  1.66M tokens: words and punctuation, lowercased), its 8,191 most common tokens (98% of
  them; the rarest seen 5 times) and one id for the rest: a 32-wide embedding of a 3-token
  context, 96 -> 128, GELU, 128 -> 8,192; constant learning rate 3e-3, batch 64 per rank.
  Held out: the late-rows mechanism was chosen on ``recsys_zipf``, this one checks it.
"""

from __future__ import annotations

import math
import re
import sys
import sysconfig
import zlib
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from charlm import CharGPT, evaluate, load_corpus, loss_fn, sample_batch  # noqa: E402


class Classification:
    """A classifier's loss: cross-entropy of ``model(x)`` against ``y``."""

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)


class NextToken(Classification):
    """The next token after a window drawn at random from a token stream (``_sample``): a batch
    from ``self.train``, the validation loss the mean of 8 batches of ``val_batch`` from
    ``self.val`` drawn by a fixed generator."""

    val_batch = 256

    def _sample(self, data, n, gen):
        raise NotImplementedError

    def batch_of(self, gen):
        return self._sample(self.train, self.batch, gen)

    @torch.no_grad()
    def val_loss(self, model):
        gen = torch.Generator().manual_seed(1234)
        return sum(self.loss(model, self._sample(self.val, self.val_batch, gen)).item()
                   for _ in range(8)) / 8


class Labelled(Classification):
    """Labelled examples, ``self.train`` and ``self.val`` as ``(x, y)``: a batch of random train
    rows, the validation loss over every validation row."""

    def batch_of(self, gen):
        i = torch.randint(0, len(self.train[1]), (self.batch,), generator=gen)
        return self.train[0][i], self.train[1][i]

    @torch.no_grad()
    def val_loss(self, model):
        return self.loss(model, self.val).item()


class GptText:
    lr, batch = 3e-3, 16

    def __init__(self):
        self.train, self.val = load_corpus()

    def model(self):
        return CharGPT(dim=64, layers=2, context=64)

    def batch_of(self, gen):
        return sample_batch(self.train, self.batch, 64, gen)

    def loss(self, model, batch):
        return loss_fn(model, *batch)

    def val_loss(self, model):
        return evaluate(model, self.val, 64)


class WordEmbed(NextToken):
    lr, batch, vocab, context = 3e-3, 64, 4096, 3

    def __init__(self):
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics)).lower()
        words = re.findall(r"[a-z_]+|[^\sa-z_]", text)
        counts: dict[str, int] = {}
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        top = sorted(counts, key=lambda w: (-counts[w], w))[: self.vocab - 1]
        index = {w: i + 1 for i, w in enumerate(top)}  # 0: any other word
        ids = torch.tensor([index.get(w, 0) for w in words])
        split = int(0.9 * len(ids))
        self.train, self.val = ids[:split], ids[split:]

    def model(self):
        return nn.Sequential(nn.Embedding(self.vocab, 32), nn.Flatten(),
                             nn.Linear(32 * self.context, 128), nn.GELU(),
                             nn.Linear(128, self.vocab))

    def _sample(self, data, n, gen):
        starts = torch.randint(0, len(data) - self.context - 1, (n,), generator=gen)
        window = data[starts[:, None] + torch.arange(self.context + 1)]
        return window[:, :-1], window[:, -1]


class Digits(Labelled):
    lr, batch = 1e-3, 32

    def __init__(self):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        x = torch.tensor(x, dtype=torch.float32)[order] / 16.0
        y = torch.tensor(y)[order]
        self.train, self.val = (x[:1500], y[:1500]), (x[1500:], y[1500:])

    def model(self):
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10))


class LargeBatch(WordEmbed):
    # LAMB's lr: word_embed's 3e-3 at a global batch of 128, times sqrt(4096 / 128).
    lr, batch = 3e-3 * (4096 / 128) ** 0.5, 2048


class CharMlp(NextToken):
    lr, batch, context, width, val_batch = 2e-3, 32, 32, 48, 512

    def __init__(self):
        self.train, self.val = load_corpus()

    def model(self):
        return nn.Sequential(nn.Embedding(256, self.width), nn.Flatten(),
                             nn.Linear(self.width * self.context, 512), nn.GELU(),
                             nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 256))

    def _sample(self, data, n, gen):
        x, y = sample_batch(data, n, self.context, gen)
        return x, y[:, -1]  # the byte after the context


class GptCosine(GptText):
    warmup = 0.05

    def schedule(self, step: int, steps: int) -> float:
        """The learning rate's factor at optimizer step ``step`` (0-based) of ``steps``."""
        ramp = max(1, round(self.warmup * steps))
        if step < ramp:
            return (step + 1) / ramp
        done = (step - ramp) / max(1, steps - 1 - ramp)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))


class BowTopics(Labelled):
    lr, batch, rows, window, dim = 3e-3, 32, 16384, 64, 64
    PACKAGES = ("asyncio", "concurrent", "ctypes", "email", "encodings", "html", "http",
                "idlelib", "importlib", "json", "logging", "multiprocessing", "tkinter",
                "unittest", "urllib", "xml")

    def __init__(self):
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        train, val = [], []
        for label, package in enumerate(self.PACKAGES):
            tokens = []
            for path in sorted((stdlib / package).rglob("*.py")):
                if "test" in path.relative_to(stdlib).parts[1:]:
                    continue  # a package's tests read like every other package's
                words = re.findall(r"[A-Za-z_][A-Za-z_0-9]*", path.read_text(errors="replace"))
                tokens += [zlib.crc32(w.encode()) % self.rows for w in words]
            if len(tokens) < 20 * self.window:
                raise RuntimeError(f"bow_topics: the standard library at {stdlib} has too "
                                   f"little of {package} ({len(tokens)} tokens)")
            ids = torch.tensor(tokens)
            cut = int(0.9 * len(ids)) // self.window * self.window
            train.append((ids[:cut].view(-1, self.window), label))
            rest = ids[cut:]
            val.append((rest[: len(rest) // self.window * self.window].view(-1, self.window),
                        label))
        self.train, self.val = self._stack(train), self._stack(val)

    @staticmethod
    def _stack(parts):
        x = torch.cat([w for w, _ in parts])
        y = torch.cat([torch.full((len(w),), label) for w, label in parts])
        return x, y

    def model(self):
        return nn.Sequential(nn.EmbeddingBag(self.rows, self.dim, mode="mean"),
                             nn.Linear(self.dim, self.dim), nn.GELU(),
                             nn.Linear(self.dim, len(self.PACKAGES)))


class RecsysZipf:
    lr, batch, users, items, dim, hidden_rank = 3e-3, 256, 40_000, 8_000, 32, 8
    exponents = (1.05, 0.9)
    val_pairs = 8192

    def __init__(self):
        gen = torch.Generator().manual_seed(59)
        # Zipf weights over ranks, given to ids in a fixed random order (the heavy ids
        # scattered over the table, as hashed or sign-up-ordered ids are).
        self.laws = []
        for n, s in zip((self.users, self.items), self.exponents, strict=True):
            weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-s)
            self.laws.append((weights / weights.sum())[torch.randperm(n, generator=gen)])
        self.u_hidden = torch.randn(self.users, self.hidden_rank, generator=gen)
        self.i_hidden = torch.randn(self.items, self.hidden_rank, generator=gen)
        self.noise = 0.1
        self.val = self._draw(self.val_pairs, torch.Generator().manual_seed(5959))

    def _draw(self, n, gen):
        u = torch.multinomial(self.laws[0], n, replacement=True, generator=gen)
        i = torch.multinomial(self.laws[1], n, replacement=True, generator=gen)
        r = (self.u_hidden[u] * self.i_hidden[i]).sum(1) / self.hidden_rank ** 0.5
        return (u, i), r + self.noise * torch.randn(n, generator=gen)

    def model(self):
        return NcfModel(self.users, self.items, self.dim)

    def batch_of(self, gen):
        return self._draw(self.batch, gen)

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    @torch.no_grad()
    def val_loss(self, model):
        return self.loss(model, self.val).item()


class NcfModel(nn.Module):
    """Neural collaborative filtering: an MLP over ``[u, i, u * i]`` of the two embeddings."""

    def __init__(self, users: int, items: int, dim: int):
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim), nn.Embedding(items, dim)
        self.head = nn.Sequential(nn.Linear(3 * dim, 128), nn.GELU(), nn.Linear(128, 1))

    def forward(self, x):
        u, i = self.user(x[0]), self.item(x[1])
        return self.head(torch.cat([u, i, u * i], dim=1)).squeeze(1)


class CodeWords(WordEmbed):
    lr, batch, vocab, context = 3e-3, 64, 8192, 3

    def __init__(self):
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        words = []
        for package in BowTopics.PACKAGES:
            for path in sorted((stdlib / package).rglob("*.py")):
                words += re.findall(r"[a-z_]+|[^\sa-z_]", path.read_text(errors="replace")
                                    .lower())
        counts: dict[str, int] = {}
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        top = sorted(counts, key=lambda w: (-counts[w], w))[: self.vocab - 1]
        index = {w: i + 1 for i, w in enumerate(top)}  # 0: any other token
        ids = torch.tensor([index.get(w, 0) for w in words])
        split = int(0.9 * len(ids))
        self.train, self.val = ids[:split], ids[split:]


STANDARD = ("gpt_text", "word_embed", "digits")
WIDER = ("char_mlp", "gpt_cosine", "bow_topics")
TAIL = ("recsys_zipf", "code_words")
WORKLOADS = {"gpt_text": GptText, "word_embed": WordEmbed, "digits": Digits,
             "large_batch": LargeBatch, "char_mlp": CharMlp, "gpt_cosine": GptCosine,
             "bow_topics": BowTopics, "recsys_zipf": RecsysZipf, "code_words": CodeWords}
# --workloads standard | wider | tail | all (benchmarks/fidelity.py).
NAMED = {"standard": STANDARD, "wider": WIDER, "tail": TAIL, "all": STANDARD + WIDER + TAIL}
