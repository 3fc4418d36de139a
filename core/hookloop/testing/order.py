"""The documented order of the hooks in one ``fit``, and the run it documents.

``FIT_ORDER`` is docs/hooks.md's **fit** sequence (tests/test_hook_order.py keeps the two
equal and both equal to a traced run of :func:`documented_fit`); the observer
conformance suite runs :func:`documented_fit` with the observer and compares the events
it receives with ``FIT_ORDER`` restricted to the hooks it implements.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable

from torch.utils.data import DataLoader

from hookloop.testing.reference import TinyClassifier, tiny_dataset

FIT_ORDER = [
    "select_devices",
    "spawn",
    "setup_environment",
    "setup",
    "model_init_context",
    "wrap_model",
    "wrap_optimizer",
    "configure_sampler",
    "configure_sampler",
    "on_fit_start",
    "on_sanity_check_start",
    "forward_context",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "reduce",
    "on_validation_end",
    "on_sanity_check_end",
    "on_train_start",
    "forward_context",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_zero_grad",
    "zero_grad",
    "accumulation_context",
    "training_step_end",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_train_batch_end",
    "on_train_batch_start",
    "training_step_end",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "optimizer_step",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "forward_context",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "reduce",
    "on_validation_end",
    "on_log_metrics",
    "on_train_epoch_end",
    "on_save_checkpoint",
    "on_save_rank_checkpoint",
    "save_checkpoint",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_zero_grad",
    "zero_grad",
    "accumulation_context",
    "training_step_end",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_train_batch_end",
    "on_train_batch_start",
    "training_step_end",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "optimizer_step",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "forward_context",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "reduce",
    "on_validation_end",
    "on_log_metrics",
    "on_train_epoch_end",
    "on_save_checkpoint",
    "on_save_rank_checkpoint",
    "save_checkpoint",
    "on_train_end",
    "on_fit_end",
    "teardown",
]


class DocumentedModule(TinyClassifier):
    """Defines ``configure_model``, so ``model_init_context`` is part of the sequence."""

    def configure_model(self):
        pass


def documented_fit(plugins: list, monitor: Callable | None = None, root: str | None = None) -> Any:
    """The documented run: 2 epochs of 2 batches, ``accumulate_grad_batches=2``, one
    validation loader with a ``sync_dist`` metric, ``num_sanity_val_steps=1``,
    checkpointing on. ``monitor(hook_name, hook_impls)`` is called before every hook
    (:func:`hookloop.dispatch.observe_hook_calls`: the step's resolved events stay direct calls)."""
    import hookloop
    from hookloop.dispatch import observe_hook_calls

    with tempfile.TemporaryDirectory(prefix="hookloop-order-") as tmp:
        trainer = hookloop.Trainer(plugins=plugins, max_epochs=2, accumulate_grad_batches=2, num_sanity_val_steps=1,
                                   default_root_dir=root or tmp)
        undo = observe_hook_calls(trainer, lambda name, impls, kwargs: monitor(name, impls)) if monitor else None
        try:
            trainer.fit(DocumentedModule(), DataLoader(tiny_dataset(16), batch_size=8),
                        DataLoader(tiny_dataset(8, seed=2), batch_size=8))
        finally:
            if undo is not None:
                undo()
    return trainer


def received_events(observer: Any) -> list[str]:
    """The hooks, in call order, whose call reached ``observer`` in :func:`documented_fit`."""
    events: list[str] = []

    def monitor(name, impls):
        if any(impl.plugin is observer for impl in impls):
            events.append(name)

    documented_fit([observer], monitor)
    return events
