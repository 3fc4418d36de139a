"""examples/gpt.py under each parallel layout, against a hand-written one-process loop.

Each layout runs the example as a user would (``python -m hookloop run [--plugins ...]
examples/gpt.py``, real gloo processes on CPU) with a tiny configuration (2 blocks,
d=32, 2 heads, 32 characters a window) for a few AdamW steps; rank 0 saves the weights
after fit (whole again under every strategy). The reference is the same model trained
on the same global batches by a plain PyTorch loop in this process, the batches cut
from ``pydoc_data.topics`` here by hand.

Default tier (``make test``): 1 process, ddp 2, fsdp 2 (per-block units), tp 2.
``make test-full`` adds fsdp with one unit, fsdp x tp on a 2x2 mesh (4 processes),
ddp + per-block compile and a 2-stage pipeline.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from conftest import REPO, run_python
from tiers import at_least  # noqa: E402

EXAMPLE = REPO / "examples" / "gpt.py"
FULL = at_least("full")
STEPS, LAYERS, DIM, HEADS, SEQ, LIMIT, LR = 4, 2, 32, 2, 32, 20_000, 3e-3
GLOBAL_BATCH = 8
TOLERANCE = 1e-5


def load_example():
    spec = importlib.util.spec_from_file_location("hookloop_example_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gpt = load_example()


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[str, list[str]]:
    """The corpus and its characters, read here from the standard library, not through
    the example."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text, sorted(set(text))


def windows(order: list[int]) -> torch.Tensor:
    """The training windows (seq + 1 ids) in ``order``, from the first ``LIMIT``
    characters' 90% training part."""
    text, chars = corpus()
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text[:LIMIT]])
    ids = ids[:int(len(ids) * 0.9)]
    return torch.stack([ids[i * SEQ:i * SEQ + SEQ + 1] for i in order])


def n_windows() -> int:
    return (int(LIMIT * 0.9) - 1) // SEQ


def reference(shuffled: bool) -> dict:
    """A plain loop: the example's GPT (same seed), AdamW, ``STEPS`` global batches of
    ``GLOBAL_BATCH`` windows; in order, or in the order a data-parallel run draws them
    (``DistributedSampler``: ``randperm`` seeded with the run's seed, 0, epoch 0; the
    replicas' batches of step i together are the permutation's i-th slice)."""
    _, chars = corpus()
    n = n_windows()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist() if shuffled else list(range(n))
    model = gpt.GPT(len(chars), layers=LAYERS, dim=DIM, heads=HEADS, seq=SEQ, lr=LR, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(STEPS):
        w = windows(order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH])
        loss = F.cross_entropy(model(w[:, :-1]).reshape(-1, len(chars)), w[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_layout(tmp_path: Path, options: list[str], replicas: int, shuffle: bool) -> dict:
    out = tmp_path / "weights.pt"
    args = [sys.executable, "-m", "hookloop", "run", *options, "--max-steps", str(STEPS), str(EXAMPLE),
            "--layers", str(LAYERS), "--dim", str(DIM), "--heads", str(HEADS), "--seq", str(SEQ),
            "--batch-size", str(GLOBAL_BATCH // replicas), "--limit", str(LIMIT), "--no-val",
            "--save-weights", str(out)]
    if not shuffle:
        args.append("--no-shuffle")
    run_python(args, cwd=tmp_path, timeout=600)
    return torch.load(out, weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# (id, hookloop run options, data-parallel replicas, training loader shuffled)
# A data-parallel run always shuffles its training data (seeded, as Lightning does); the
# one-process and tp runs take the loader as it is, here in order.
LAYOUTS = [
    ("one-process", [], 1, False),
    ("ddp2", ["--plugins", "ddp", "--devices", "2"], 2, True),
    ("fsdp2-per-block", ["--plugins", "fsdp", "--devices", "2", "--plugin-option", "fsdp.auto_wrap_policy=Block"],
     2, True),
    ("tp2", ["--plugins", "tp", "--devices", "2"], 1, False),
]
FULL_LAYOUTS = [
    ("fsdp2-one-unit", ["--plugins", "fsdp", "--devices", "2"], 2, True),
    ("fsdp2xtp2", ["--plugins", "fsdp,tp", "--devices", "4", "--mesh", "dp_shard=2,tp=2"], 2, True),
    ("ddp2-compile-blocks", ["--plugins", "ddp,compile", "--devices", "2",
                             "--plugin-option", "compile.blocks=Block"], 2, True),
    # hookloop-pipeline (branch i21-pipeline): the stages of GPT.configure_pipeline
    ("pp2", ["--plugins", "pipeline", "--devices", "2"], 1, False),
    # pipeline x fsdp (branch i21-ppfsdp): each rank's stage sharded per Block on dp_shard
    ("pp2xfsdp2", ["--plugins", "pipeline,fsdp", "--devices", "4", "--mesh", "pp=2,dp_shard=2",
                   "--plugin-option", "fsdp.meta_init=false", "--plugin-option", "fsdp.auto_wrap_policy=Block"],
     2, True),
    ("pp2xfsdp2xtp2", ["--plugins", "fsdp,tp,pipeline", "--devices", "8", "--mesh", "pp=2,dp_shard=2,tp=2",
                       "--plugin-option", "fsdp.meta_init=false"], 2, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("options, replicas, shuffle", [pytest.param(*rest, id=i) for i, *rest in LAYOUTS])
def test_each_layout_equals_the_hand_written_one_process_loop(tmp_path, options, replicas, shuffle):
    weights = run_layout(tmp_path, options, replicas, shuffle)
    expected = reference(shuffled=shuffle)
    assert max_diff(weights, expected) <= TOLERANCE
    # and they moved: the comparison is not of two untrained models
    initial = gpt.GPT(len(corpus()[1]), layers=LAYERS, dim=DIM, heads=HEADS, seq=SEQ, seed=0).state_dict()
    assert max_diff(weights, initial) > 100 * TOLERANCE


@pytest.mark.full  # the long matrix
@pytest.mark.parametrize("options, replicas, shuffle", [pytest.param(*rest, id=i) for i, *rest in FULL_LAYOUTS])
def test_each_layout_of_the_full_matrix_equals_the_hand_written_loop(tmp_path, options, replicas, shuffle):
    weights = run_layout(tmp_path, options, replicas, shuffle)
    assert max_diff(weights, reference(shuffled=shuffle)) <= TOLERANCE


def test_the_data_is_the_installed_corpus_and_a_short_fit_beats_a_uniform_guess(tmp_path):
    import pydoc_data.topics

    import hookloop

    # the standard library's own file: shipped with Python, nothing downloaded
    assert Path(pydoc_data.topics.__file__).resolve().is_relative_to(Path(sysconfig.get_paths()["stdlib"]).resolve())
    text, chars = corpus()
    data = gpt.TextDataModule(seq=SEQ, batch_size=16)
    assert data.text == text and len(text) > 400_000
    assert data.vocab.chars == chars and data.vocab.decode(data.vocab.encode(text[:500])) == text[:500]
    data.setup("fit")
    cut = int(len(text) * 0.9)
    assert len(data.train) == (cut - 1) // SEQ and len(data.val) == (len(text) - cut - 1) // SEQ
    x, y = data.val[3]
    assert data.vocab.decode(x) == text[cut + 3 * SEQ:cut + 4 * SEQ] and torch.equal(x[1:], y[:-1])

    hookloop.seed_everything(0)
    model = gpt.GPT(len(chars), layers=LAYERS, dim=DIM, heads=HEADS, seq=SEQ, lr=LR)
    trainer = hookloop.Trainer(max_steps=150, limit_val_batches=0, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    model.eval()
    with torch.no_grad():  # the mean loss over 40 validation windows, computed here
        batch = [data.val[i] for i in range(40)]
        xs, ys = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
        val = float(F.cross_entropy(model(xs).reshape(-1, len(chars)), ys.reshape(-1)))
    uniform = math.log(len(chars))  # 103 characters: 4.635
    assert val < uniform - 1.0, (val, uniform)
