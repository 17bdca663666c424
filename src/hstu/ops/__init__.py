"""Operating hstu on Ascend NPU, CUDA and CPU hosts: the knowledge of the field as tools.

- :mod:`hstu.ops.doctor` -- ``hstu doctor``: this host vs the known-good table ``compat.toml``.
- :mod:`hstu.ops.diagnose` -- ``hstu diagnose``: logs vs the knowledge base ``knowledge_base.yaml``.
- :mod:`hstu.ops.monitor` / :mod:`hstu.ops.metrics` -- ``hstu monitor``: Prometheus exporter.
- :mod:`hstu.ops.alerts` -- composite alert rules with ``for`` durations, usable in-process
  (``AlertEngine``) and exportable as Prometheus alerting rules.
- :mod:`hstu.ops.watchdog` -- ``hstu watchdog``: reset detection and cold-start recovery.
- :mod:`hstu.ops.cli` -- ``add_subcommands(subparsers)`` for the top-level CLI.

Nothing here imports torch at module import time except :mod:`hstu.ops.doctor` (through probes,
lazily); torch_npu and nvidia-ml-py are probed, never required.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AlertEngine", "AlertRule", "Sample", "load_rules"]


def __getattr__(name: str) -> Any:  # lazy: importing hstu.ops must not need the `ops` extra (pyyaml)
    if name in __all__:
        from hstu.ops import alerts

        return getattr(alerts, name)
    raise AttributeError(f"module 'hstu.ops' has no attribute {name!r}")
