"""A small GPT trained on the English text that ships with Python (no download).

Character-level language modelling of ``pydoc_data.topics``: the text of ``help()``'s
topics, about 465,000 characters of English prose and code, part of the standard
library of every CPython (so present in every venv, with no package to install and no
network). Its 103 distinct characters are the vocabulary.

The model is the usual pre-norm decoder: token and position embeddings, ``layers``
blocks of (LayerNorm, causal self-attention, LayerNorm, MLP), a final LayerNorm and the
LM head. It is written so that each parallel layout takes it as it is:

* the attention projections are ``q_proj``/``k_proj``/``v_proj``/``out_proj`` and the
  MLP is ``fc1``, ``act``, ``fc2``: hookloop-tp's automatic plan splits both (heads by
  process, the MLP's hidden features), and the heads are a ``view(b, t, -1, head_dim)``;
* the blocks are a top-level ``nn.ModuleList`` (``model.blocks``) of the class ``Block``:
  fsdp wraps each (``fsdp.auto_wrap_policy=Block``), compile compiles each
  (``compile.blocks=Block``);
* ``configure_pipeline(num_stages)`` cuts the blocks into hookloop-pipeline's stages,
  the embeddings (``model.embed``) in the first and the final norm and LM head
  (``model.head``) in the last, and ``pipeline_loss(logits, targets)`` is the loss the
  last stage computes.

Run it (``hookloop run``'s options become the Trainer's defaults; the script's own
options, after its path, set the model's size):

    hookloop run examples/gpt.py                                            # one process
    hookloop run --plugins ddp --devices 2 examples/gpt.py                  # ddp
    hookloop run --plugins fsdp --devices 2 --plugin-option fsdp.auto_wrap_policy=Block examples/gpt.py
    hookloop run --plugins tp --devices 2 examples/gpt.py                   # tensor parallel
    hookloop run --plugins pipeline --devices 2 examples/gpt.py             # 2 pipeline stages
    hookloop run --plugins fsdp,tp --devices 4 --mesh dp_shard=2,tp=2 examples/gpt.py          # 2-D
    hookloop run --plugins fsdp,tp,pipeline --devices 8 --mesh pp=2,dp_shard=2,tp=2 examples/gpt.py  # 3-D
    hookloop run --plugins ddp,compile --devices 2 --plugin-option compile.blocks=Block examples/gpt.py

    hookloop run examples/gpt.py --layers 2 --dim 32 --heads 2 --seq 32 --batch-size 8

(``heads`` must be divisible by the tp size, and ``4 * dim`` too; under pipeline the
micro-batches must divide ``--batch-size``.) It prints the validation loss next to
ln(vocab), the loss of a uniform guess. Which layouts run today, and how exactly each
matches one process: benchmarks/README.md, "N-D parallelism".
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import hookloop


# -- the data --------------------------------------------------------------------------


def corpus_text() -> str:
    """The text of ``pydoc_data.topics`` (the standard library's ``help()`` topics), the
    topics in sorted order: the same string on every process and every machine."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


class Vocabulary:
    """Characters <-> ids: the sorted characters of the text."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class Chunks(Dataset):
    """Non-overlapping windows of ``seq + 1`` ids: (input ``seq`` ids, the next ``seq``)."""

    def __init__(self, ids: torch.Tensor, seq: int):
        self.ids, self.seq = ids, seq
        self.n = (len(ids) - 1) // seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        window = self.ids[i * self.seq: i * self.seq + self.seq + 1]
        return window[:-1], window[1:]


class TextDataModule(hookloop.DataModule):
    """The corpus split 90/10 (train / validation, by position), cut into windows.

    ``limit``: use only the first ``limit`` characters (a quick run); ``shuffle``: the
    training windows in a random order (seeded by ``hookloop.seed_everything``).
    """

    def __init__(self, seq: int = 64, batch_size: int = 16, limit: int | None = None, shuffle: bool = True,
                 val_fraction: float = 0.1):
        super().__init__()
        self.seq, self.batch_size, self.limit, self.shuffle = seq, batch_size, limit, shuffle
        self.val_fraction = val_fraction
        text = corpus_text()
        self.vocab = Vocabulary(text)  # the whole corpus's characters, whatever the limit
        self.text = text[:limit] if limit else text
        self.train: Chunks | None = None
        self.val: Chunks | None = None

    def setup(self, stage: str) -> None:
        ids = self.vocab.encode(self.text)
        cut = int(len(ids) * (1 - self.val_fraction))
        self.train, self.val = Chunks(ids[:cut], self.seq), Chunks(ids[cut:], self.seq)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size, drop_last=True)


# -- the model -------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. The heads are a view of ``-1`` (not of
    ``heads``): under tensor parallelism each process holds ``heads / tp`` of them.

    ``k_proj`` has no bias: a constant added to a query's scores changes nothing after the
    softmax, so that bias's gradient is zero in exact arithmetic, and Adam would turn the
    rounding noise of the layouts into full-size steps."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}")
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embeddings(nn.Module):
    """Token plus position embeddings."""

    def __init__(self, vocab: int, dim: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class LMHead(nn.Module):
    """The final LayerNorm and the projection to the vocabulary's logits."""

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.logits = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.logits(self.norm(x))


class GPT(hookloop.Module):
    """A character-level GPT (see the module docstring): ``embed``, ``blocks`` (an
    ``nn.ModuleList`` of ``Block``), ``head``. ``seed`` fixes the initial weights, so
    every layout starts from the same model."""

    def __init__(self, vocab: int, layers: int = 4, dim: int = 128, heads: int = 4, seq: int = 64,
                 lr: float = 3e-3, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.vocab, self.seq, self.lr = vocab, seq, lr
        self.embed = Embeddings(vocab, dim, seq)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = LMHead(dim, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pipeline_loss(self, logits, targets):
        """The loss of a batch's logits: what a pipeline's last stage computes (and ``loss``)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def loss(self, batch):
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def configure_pipeline(self, num_stages: int) -> list[nn.Module]:
        """The pipeline's stages (hookloop-pipeline asks for them): the blocks in equal
        consecutive runs (the first stages one block longer when they do not divide), the
        embeddings before the first stage's blocks and the head after the last's. The
        stages hold the module's own layers, so training them trains the module."""
        if not 1 <= num_stages <= len(self.blocks):
            raise hookloop.ConfigurationError(
                f"GPT has {len(self.blocks)} blocks and the pipeline asks for {num_stages} stages: every stage "
                f"needs at least one block (--layers N, or fewer stages)")
        base, extra = divmod(len(self.blocks), num_stages)
        stages, start = [], 0
        for s in range(num_stages):
            end = start + base + (1 if s < extra else 0)
            parts = [*([self.embed] if s == 0 else []), *self.blocks[start:end],
                     *([self.head] if s == num_stages - 1 else [])]
            stages.append(nn.Sequential(*parts))
            start = end
        return stages

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.0)


# -- the script ------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/gpt.py", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="per data-parallel replica")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--limit", type=int, default=None, help="use only the corpus's first N characters")
    p.add_argument("--no-shuffle", action="store_true", help="the training windows in order")
    p.add_argument("--val-every", type=int, default=100, help="validate every N training steps")
    p.add_argument("--no-val", action="store_true", help="skip validation")
    p.add_argument("--save-weights", default=None, help="rank 0 saves the trained weights (whole) here")
    return p.parse_args(argv)


def main(argv=None) -> float | None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    hookloop.seed_everything(0)
    data = TextDataModule(seq=args.seq, batch_size=args.batch_size, limit=args.limit, shuffle=not args.no_shuffle)
    model = GPT(len(data.vocab), layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq, lr=args.lr)
    trainer = hookloop.Trainer(max_steps=hookloop.default(200),  # --max-steps overrides
                               limit_val_batches=0 if args.no_val else hookloop.default(20),
                               val_check_interval=args.val_every, check_val_every_n_epoch=None,
                               enable_checkpointing=hookloop.default(False))
    trainer.fit(model, datamodule=data)
    if args.save_weights and trainer.global_rank == 0:
        # after fit the module is whole again under every strategy (fsdp, tp gather it)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.save_weights)
    val = trainer.callback_metrics.get("val_loss")
    if val is not None:
        trainer.print(f"gpt: val_loss {float(val):.4f} (uniform guess ln({len(data.vocab)}) = "
                      f"{math.log(len(data.vocab)):.4f}), {trainer.global_step} steps")
        return float(val)
    return None


if __name__ == "__main__":
    main()
