"""Models of outside code for the tp plan checks (tests/test_tp_plan.py, tp_plan_battery.py):
a compact copy of nanoGPT's model.py (a fused ``c_attn`` split with ``split(n_embd)``,
heads from ``self.n_head``, a GELU MLP ``c_fc``/``c_proj``, tied embedding and head) and a
Hugging Face ``LlamaForCausalLM`` built from a config (grouped-query attention, a gated
MLP), each wrapped in a ``hookloop.Module``; ``reference`` trains either by a hand-written
loop in one process."""

from __future__ import annotations

import math
import os

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import hookloop

VOCAB, SEQ, EMBD, HEADS = 128, 8, 32, 4
STEPS, BATCH = 4, 4
#: (model, tp option plan) trained by tp_plan_battery.py
CASES = (("nanogpt", "auto"), ("llama", "hf"), ("llama", "infer"), ("qwen3", "auto"), ("phi3", "hf"))


def tokens(n: int = STEPS * BATCH, seed: int = 3) -> TensorDataset:
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(t[:, :-1], t[:, 1:])


class CausalSelfAttention(nn.Module):
    """nanoGPT's: one fused q/k/v projection, the heads counted by ``self.n_head``."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)
        self.n_head, self.n_embd = HEADS, EMBD

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * EMBD, EMBD)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(EMBD), CausalSelfAttention(), nn.LayerNorm(EMBD), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT: token and position embeddings, blocks, a final norm, a tied head."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(SEQ, EMBD), drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block() for _ in range(layers)]), ln_f=nn.LayerNorm(EMBD)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def hugging_face(kind: str):
    """A tiny Hugging Face causal LM from a config (no download), 4 query heads and 2
    key/value heads: ``llama`` (a gated MLP), ``qwen3`` (``q_norm``/``k_norm`` on the heads:
    its plan's ``replicated_with_grad_allreduce`` has no torch style), ``phi3`` (fused
    ``qkv_proj`` and ``gate_up_proj``, ``colwise_gather_output``/``rowwise_split_input``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    config, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                     "phi3": ("Phi3Config", "Phi3ForCausalLM")}[kind]
    config = getattr(transformers, config)(
        hidden_size=EMBD, intermediate_size=64, num_attention_heads=HEADS, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    return getattr(transformers, model)(config)


def llama():
    """A tiny ``LlamaForCausalLM`` from a config: grouped-query attention, a gated MLP."""
    return hugging_face("llama")


class LM(hookloop.Module):
    """``kind`` (``"nanogpt"``, or a Hugging Face one: ``"llama"``, ``"qwen3"``, ``"phi3"``) as a
    language model trained with SGD."""

    def __init__(self, kind: str, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        self.net = GPT() if kind == "nanogpt" else hugging_face(kind)

    def forward(self, idx):
        out = self.net(idx)
        return out if self.kind == "nanogpt" else out.logits

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def reference(kind: str, steps: int = STEPS) -> tuple[dict, list[float]]:
    """The same model and batches trained by a hand-written loop in one process:
    (weights after ``steps`` steps, each step's loss)."""
    model = LM(kind)
    opt = model.configure_optimizers()
    ds, losses = tokens(), []
    for i in range(steps):
        opt.zero_grad()
        loss = model.loss(ds[i * BATCH:(i + 1) * BATCH])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
