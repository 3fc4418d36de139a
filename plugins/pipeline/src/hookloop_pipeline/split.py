"""The split of a module into pipeline stages (no process group needed: testable alone).

In this order of precedence:

1. the module's ``configure_pipeline(self, num_stages)`` hook, returning ``num_stages``
   modules, applied one after the other;
2. the module's ``pipeline_stages`` attribute: such a sequence (its length must be the
   number of stages);
3. the automatic split: the module's top-level ``nn.Sequential`` or ``nn.ModuleList`` of
   blocks (the module itself when it is an ``nn.Sequential``), cut into consecutive runs
   of blocks at ``split_points`` (block indices, or names such as ``"blocks.2"``, as
   torchtitan's ``pipeline_parallel_split_points``), else into runs of equal length (the
   first ones one block longer when the blocks do not divide evenly).

Every trainable parameter of the module must lie in some stage: one outside all of
them would be trained by no rank.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from hookloop import ConfigurationError


def _container(module: nn.Module) -> tuple[str, nn.Module]:
    """``(attribute name, container)`` of the module's blocks for the automatic split."""
    if isinstance(module, nn.Sequential):
        return "", module
    found = [(n, c) for n, c in module.named_children() if isinstance(c, (nn.Sequential, nn.ModuleList))]
    if len(found) != 1:
        what = (f"it has {len(found)} ({', '.join(n for n, _ in found)})" if found else "it has none")
        raise ConfigurationError(
            f"the pipeline plugin splits the module's top-level nn.Sequential or nn.ModuleList of "
            f"blocks into stages, and {type(module).__name__} needs exactly one: {what}. Keep the "
            f"blocks in one container (self.blocks = nn.Sequential(...)), or give the stages "
            f"yourself: a pipeline_stages attribute or configure_pipeline(self, num_stages)")
    return found[0]


def split_blocks(n_blocks: int, n_stages: int, split_points: Sequence[Any] | None = None,
                 prefix: str = "") -> list[range]:
    """The block indices of each stage: ``n_stages`` consecutive, non-empty ranges.

    ``split_points``: the first block of every stage but the first (``n_stages - 1`` of
    them, increasing), as indices or as ``"<container>.<index>"`` names."""
    if n_stages > n_blocks:
        raise ConfigurationError(
            f"the pipeline has {n_stages} stages (pp x virtual_stages) and the module {n_blocks} "
            f"block(s): every stage needs at least one block. Use fewer stages (--mesh pp=..., "
            f"virtual_stages) or split the model into more blocks")
    if split_points is None:
        base, extra = divmod(n_blocks, n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
        starts = [sum(sizes[:s]) for s in range(n_stages)]
    else:
        points = []
        for p in split_points:
            if isinstance(p, str):
                name = p[len(prefix) + 1:] if prefix and p.startswith(prefix + ".") else p
                if not name.isdigit():
                    raise ConfigurationError(
                        f"pipeline option split_points: {p!r} is not a block index or a block's name "
                        f"({prefix + '.' if prefix else ''}<index>, e.g. {(prefix + '.') if prefix else ''}2)")
                p = int(name)
            points.append(p)
        if len(points) != n_stages - 1:
            raise ConfigurationError(
                f"pipeline option split_points={list(split_points)!r} gives {len(points) + 1} stages, "
                f"and the pipeline has {n_stages} (pp x virtual_stages): give {n_stages - 1} split points")
        if any(not (0 < a < n_blocks) for a in points) or any(a >= b for a, b in zip(points, points[1:])):
            raise ConfigurationError(
                f"pipeline option split_points={list(split_points)!r}: each must be a block index "
                f"between 1 and {n_blocks - 1}, increasing (the first block of every stage but the first)")
        starts = [0, *points]
    ends = [*starts[1:], n_blocks]
    return [range(a, b) for a, b in zip(starts, ends)]


def stage_modules(module: nn.Module, n_stages: int, split_points: Sequence[Any] | None = None) -> list[nn.Module]:
    """The ``n_stages`` modules of the pipeline, in order (see the module docstring). They
    are the module's own layers (no copies): training a stage trains the module."""
    hook = getattr(module, "configure_pipeline", None)
    stages = None
    if callable(hook):
        stages, source = hook(n_stages), "configure_pipeline(num_stages)"
    elif getattr(module, "pipeline_stages", None) is not None:
        stages, source = module.pipeline_stages, "pipeline_stages"
    if stages is not None:
        stages = list(stages)
        if len(stages) != n_stages or not all(isinstance(s, nn.Module) for s in stages):
            raise ConfigurationError(
                f"{type(module).__name__}.{source} gave {len(stages)} object(s), and the pipeline has "
                f"{n_stages} stages (pp x virtual_stages): it must give {n_stages} nn.Module stages")
        if split_points is not None:
            raise ConfigurationError(
                f"pipeline option split_points is for the automatic split; {type(module).__name__} "
                f"gives its stages itself ({source})")
    else:
        prefix, blocks = _container(module)
        ranges = split_blocks(len(blocks), n_stages, split_points, prefix)
        stages = [nn.Sequential(*[blocks[i] for i in r]) for r in ranges]
    inside = {id(p) for s in stages for p in s.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ConfigurationError(
            f"the pipeline trains the parameters of its stages, and {type(module).__name__} has "
            f"trainable parameters in no stage ({', '.join(outside[:5])}{', ...' if len(outside) > 5 else ''}): "
            f"move those layers into the blocks, or give the stages yourself (configure_pipeline)")
    return stages
