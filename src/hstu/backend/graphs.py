"""Device graphs: capture a function once, replay it (CUDA graphs; NPU graphs under torch_npu).

PyTorch docs, "CUDA Graphs" (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs);
torch_npu mirrors the API as ``torch.npu.NPUGraph`` / ``torch.npu.graph``. A backend that can
capture returns a :class:`GraphRunner` from ``Backend.capture_graph(fn)``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

# graph modes an engine may ask for; the device ones are owned by one backend each (Backend.graph_mode)
GRAPH_MODES = ("auto", "eager", "compile", "cuda_graph", "npu_graph")


class GraphRunner:
    """Capture ``fn`` (it must read only static buffers) into a device graph; calls replay it.

    Device-generic over ``api`` = ``torch.cuda`` or ``torch.npu`` (``Stream``, ``current_stream``,
    ``stream``, ``graph``) with ``graph_cls`` = its graph class. Two warm-up runs on a side stream
    first, as the PyTorch docs require; ``fn`` must be idempotent (it is run three times before the
    first replay).

    Calling returns the tensor ``fn`` returned at capture, refreshed in place by the replay.
    """

    def __init__(self, fn: Callable[[], torch.Tensor], api: ModuleType, graph_cls: type) -> None:
        side = api.Stream()
        side.wait_stream(api.current_stream())
        with api.stream(side):
            for _ in range(2):
                fn()
        api.current_stream().wait_stream(side)
        self.graph = graph_cls()
        with api.graph(self.graph):
            self.out = fn()

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


__all__ = ["GRAPH_MODES", "GraphRunner"]
