"""Local stand-ins, generated deterministically, for the data Lightning's scripts download.

Each writes, under the run's working directory, a file of the shape and format the
script reads at the path it reads it, so the script's download step finds it present
and skips the network. The script itself is unchanged.
"""

from __future__ import annotations

from pathlib import Path


def _lcg(seed: int):
    state = seed
    while True:
        state = (1103515245 * state + 12345) % 2**31
        yield state


def wikitext2(workdir: Path, blocks: int = 4002, vocab: int = 120) -> Path:
    """``./data/wikitext-2.txt`` (``lightning.pytorch.demos.WikiText2``'s file): lines of
    words over a small vocabulary, with structure to learn (each word mostly predicts the
    next). basics/transformer.py splits the dataset into ``n - 4000``, 2000 and 2000 blocks
    of 35 tokens; ``blocks=4002`` (the dataset's length, ``<eos>`` tokens included) leaves
    it 2 training blocks, the least that keeps its 20 epochs runnable on a CPU."""
    tokens = 35 * (blocks + 1)
    path = Path(workdir) / "data" / "wikitext-2.txt"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = _lcg(1234)
    words = [f"w{i}" for i in range(vocab)]
    lines, line, current = [], [], 0
    count = 0
    while count < tokens:
        r = next(rng)
        count += 1
        current = (current * 7 + 3) % vocab if r % 4 else r % vocab
        line.append(words[current])
        if len(line) >= 12 + r % 9 or count == tokens - 1:
            lines.append(" " + " ".join(line) + " \n")
            count += 1  # the <eos> WikiText2 adds per line
            line = []
    path.write_text("".join(lines))
    return path


def mnist(workdir: Path, train: int = 1000, test: int = 200) -> Path:
    """``./data/MNIST/complete/{training,test}.pt`` in the format of
    ``lightning.pytorch.demos.mnist_datamodule._MNIST``: ``(uint8 [N, 28, 28], int64 [N])``,
    each digit a class-dependent blob plus noise."""
    import torch

    folder = Path(workdir) / "data" / "MNIST" / "complete"
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for name, n in (("training.pt", train), ("test.pt", test)):
        targets = torch.randint(0, 10, (n,), generator=g)
        images = torch.rand(n, 28, 28, generator=g) * 60
        for digit in range(10):
            rows = slice(2 + 2 * digit, 8 + 2 * digit)
            images[targets == digit, rows, 4:24] += 180
        torch.save((images.clamp(0, 255).to(torch.uint8), targets), folder / name)
    return folder
