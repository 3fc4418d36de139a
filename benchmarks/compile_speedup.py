"""torch.compile's speedup on CPU, as the compile plugin applies it: training steps/s,
eager against compiled with inductor.

Two models: an MLP (``--width``, 3 layers) and a small transformer (2 pre-norm blocks:
attention and an MLP, ``--dim``, sequences of ``--seq`` tokens), each compiled the
plugin's way (``hookloop_compile.compile_in_place``, in place: the MLP whole, the
transformer per block and whole). A step is forward, cross-entropy, backward and an SGD step.
Compilation (the first steps) is timed apart; then eager and compiled run in interleaved
rounds of ``--steps`` steps, and the medians over the rounds are printed with their ratio
(compiled steps/s over eager steps/s).

    nice -n 19 python benchmarks/compile_speedup.py [--rounds 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from hookloop_compile import compile_in_place


class Block(nn.Module):
    """Pre-norm transformer block: self-attention, then a 4x MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, dim: int, heads: int = 4, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(blocks)])
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.blocks(x).mean(1))


class MLP(nn.Module):
    def __init__(self, width: int, classes: int = 10):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return n / (time.perf_counter() - start)


def compare(name: str, model: nn.Module, targets, x, y, rounds: int, steps: int) -> None:
    eager_model, compiled_model = model, copy.deepcopy(model)
    for target in targets(compiled_model):
        compile_in_place(target, {"backend": "inductor"})
    eager, compiled = stepper(eager_model, x, y), stepper(compiled_model, x, y)
    start = time.perf_counter()
    for _ in range(3):  # compiles forward and backward (and any recompile of the second step)
        compiled()
    compile_s = time.perf_counter() - start
    for _ in range(3):
        eager()
    rates: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(rounds):  # interleaved: a change in the machine's load hits both alike
        rates["eager"].append(timed(eager, steps))
        rates["compiled"].append(timed(compiled, steps))
    e, c = statistics.median(rates["eager"]), statistics.median(rates["compiled"])
    print(f"{name:<40} eager {e:8.1f} steps/s   compiled {c:8.1f} steps/s   "
          f"compiled/eager {c / e:5.2f}   (compile {compile_s:5.1f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds} interleaved rounds of {args.steps} steps, medians")
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    compare(f"MLP {args.width}x3, batch {args.batch} (whole)", MLP(args.width), lambda m: [m], x, y,
            args.rounds, args.steps)
    x, y = torch.randn(8, args.seq, args.dim), torch.randint(0, 10, (8,))
    compare(f"transformer d{args.dim} 2 blocks, 8x{args.seq} (per block)", Transformer(args.dim),
            lambda m: list(m.blocks), x, y, args.rounds, args.steps)
    compare(f"transformer d{args.dim} 2 blocks, 8x{args.seq} (whole)", Transformer(args.dim),
            lambda m: [m], x, y, args.rounds, args.steps)


if __name__ == "__main__":
    main()
