"""hookloop.testing: a conformance kit for plugin authors, installed with the core.

* :func:`run_processes` (and the pytest fixture ``hookloop_processes``): run a function
  on N real processes as the ranks of a torchrun-like job; per-rank results, exceptions
  re-raised with the rank named, stragglers killed after a timeout.
* :class:`TinyClassifier`, :func:`tiny_dataset`, :func:`reference_fit`: a tiny model and
  data set, and the hand-written PyTorch loop a data-parallel run must reproduce.
* Conformance suites by role, enabled for a plugin in one line::

      from hookloop.testing import StrategyConformance

      class TestMyStrategy(StrategyConformance):
          plugin = "mystrategy"

  :class:`StrategyConformance`, :class:`ObserverConformance`,
  :class:`PrecisionConformance`, :class:`DevicesConformance`, :class:`ExtensionConformance`
  (one process and ddp, its checkpoint state, a resume), and :class:`ResumeConformance`
  (SIGKILL a job inside a step, a save, a validation and an accumulation window; the
  restarted job must end bit-identical to an uninterrupted one); and for a launcher
  :class:`LauncherConformance` (workers where it said, their identity and environment,
  results back to the caller, restarts decided in the worker, no orphans, even after a
  SIGKILL). See docs/plugin-authors.md.

The pytest plugin (entry point ``pytest11``: ``hookloop``) only adds the fixture; it is
inactive unless a test uses it.
"""

from hookloop.testing.processes import ProcessError, free_port, run_processes
from hookloop.testing.reference import IndexedDataset, TinyClassifier, max_difference, reference_fit, tiny_dataset, weights


def __getattr__(name):
    # The suites import pytest; keep `import hookloop.testing` free of it until asked.
    if name in ("StrategyConformance", "ObserverConformance", "PrecisionConformance", "DevicesConformance",
                "ResumeConformance", "ExtensionConformance"):
        from hookloop.testing import conformance

        return getattr(conformance, name)
    if name == "LauncherConformance":
        from hookloop.testing import launcher

        return launcher.LauncherConformance
    raise AttributeError(name)


__all__ = [
    "DevicesConformance", "ExtensionConformance", "IndexedDataset", "LauncherConformance", "ObserverConformance", "PrecisionConformance", "ProcessError",
    "ResumeConformance", "StrategyConformance",
    "TinyClassifier", "free_port", "max_difference", "reference_fit", "run_processes", "tiny_dataset", "weights",
]
