"""hstu: train, evaluate, generate with and serve HSTU generative recommenders.

HSTU: Zhai et al., "Actions Speak Louder than Words: Trillion-Parameter Sequential
Transducers for Generative Recommendations", ICML 2024.

The public Python API (the objects the CLI itself runs; imported on first use, so ``import hstu``
stays light)::

    import hstu

    rec = hstu.Recommender.from_run("runs/ml1m")                  # a trained run directory
    prep = rec.prepare(hstu.History(items=[1, 48, 150], timestamps=[978300760, 978300761, 978300762]))
    rec.recommend([prep], k=5)                                      # [[{"item_id", "score", ...}, ...]]
    rec.recommend([prep], k=5, decoding=hstu.DecodeOptions("beam", beam_width=4))

    metrics = hstu.fit("runs/new", hstu.model_config_from_preset("small"), hstu.TrainConfig(epochs=2),
                       hstu.DataSpec(dataset="ml-1m", data_dir="../shared/data/ml-1m"))

``recommend`` takes prepared histories (``rec.prepare``), k an int, decoding a DecodeOptions (or its
fields as keywords: ``strategy="beam", beam_width=4``); one Recommender may be shared by threads (its
generation calls run one at a time). Each name's docstring gives shapes, types and errors.

Names: Recommender, History (hstu.generate.recommend); fit (hstu.train.loop); DataSpec
(hstu.data.prepare); ModelConfig, TrainConfig, DecodeOptions, ServeConfig, load_config_file,
model_config_from_preset (hstu.config); load_run, read_config (hstu.runs).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "Recommender": "hstu.generate.recommend",
    "History": "hstu.generate.recommend",
    "fit": "hstu.train.loop",
    "DataSpec": "hstu.data.prepare",
    "ModelConfig": "hstu.config",
    "TrainConfig": "hstu.config",
    "DecodeOptions": "hstu.config",
    "ServeConfig": "hstu.config",
    "load_config_file": "hstu.config",
    "model_config_from_preset": "hstu.config",
    "load_run": "hstu.runs",
    "read_config": "hstu.runs",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use (PEP 562)."""
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hstu' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
