"""``hstu export``: a trained run's encoder for other runtimes (issue 23, item 5).

- :mod:`hstu.export.encoder`: :class:`UserEncoder`, the prefill from padded histories to the
  L2-normalised user vector through the model's own encode (no second copy of the equations);
- :mod:`hstu.export.onnx_export`: ONNX (torch.onnx dynamo exporter, checked with onnxruntime);
- :mod:`hstu.export.pt2_export`: torch.export programs (.pt2);
- :mod:`hstu.export.bundle`: :func:`export_run`, the export directory (programs per bucket,
  items.npy, idmap.json, export.json), written whole or not at all;
- :mod:`hstu.export.cli`: the command.
"""

from hstu.export.bundle import ExportError, export_run

__all__ = ["ExportError", "export_run"]
