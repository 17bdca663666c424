"""Training state for --resume: moved to :mod:`hstu.runs` (issue 18: one module owns the run
directory, its last checkpoint included). These names stay importable from here."""

from hstu.runs import MANIFEST_KEY, has_train_state, load_train_state, repair_run_files, save_train_state

__all__ = ["MANIFEST_KEY", "has_train_state", "load_train_state", "repair_run_files", "save_train_state"]
