"""HSTU model: embeddings, relative bias, attention, encoder."""

from hstu.model.hstu import HSTULayer, HSTUModel, build_hstu, l2_normalize

__all__ = ["HSTULayer", "HSTUModel", "build_hstu", "l2_normalize"]
