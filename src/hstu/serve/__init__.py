"""HTTP service: FastAPI app, micro-batcher per length bucket, Prometheus metrics.

``create_app(cfg, recommender)`` builds the app (:mod:`hstu.serve.app`); ``hstu serve --run RUN``
runs it under uvicorn (:mod:`hstu.serve.cli`). Layers, calls going down only (STYLE.md §2):
app (routes, error handlers, middleware; :mod:`hstu.serve.edge`) → service (:mod:`hstu.serve.service`:
input checks, cold start; :mod:`hstu.serve.batcher`: admission, queues per bucket, deadlines,
backpressure) → executor (:class:`hstu.serve.executor.Executor`: a model thread, or model processes,
:mod:`hstu.serve.worker`, started and stopped in the app's lifespan; memory guard) → runner (one
batch on the model) → ``hstu.generate``.
"""

from hstu.serve.app import ApiError, ServePolicy, create_app
from hstu.serve.batcher import MicroBatcher, Rejected
from hstu.serve.metrics import ServeMetrics
from hstu.serve.popularity import Popularity, popularity_for_run, popularity_from_log
from hstu.serve.runner import BatchRunner, DecodeOptions, Job

__all__ = [
    "ApiError",
    "BatchRunner",
    "DecodeOptions",
    "Job",
    "MicroBatcher",
    "Popularity",
    "Rejected",
    "ServeMetrics",
    "ServePolicy",
    "create_app",
    "popularity_for_run",
    "popularity_from_log",
]
