"""Live-server helpers shared by the serve and generation-path tests: uvicorn in a thread on a
pre-bound loopback socket, httpx clients, request bodies from ratings and the direct-Recommender /
float64 references the answers are compared with."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import httpx
import numpy as np
import pandas as pd
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from hstu.config import ServeConfig
from hstu.generate.recommend import History, Recommender
from hstu.serve.app import ServePolicy, create_app
from hstu.serve.cli import bind

BUCKETS = [10, 20, 50]


# ----------------------------------------------------------------------------------------------
# live servers (the tiny trained run and its ratings are conftest.py's session fixtures)
# ----------------------------------------------------------------------------------------------
class LiveServer:
    """uvicorn in a thread on a pre-bound loopback socket; waits for /readyz (or /healthz)."""

    def __init__(self, app, wait_ready: bool = True) -> None:
        self.app = app
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=30))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.wait_ready = wait_ready

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        probe = "/readyz" if self.wait_ready else "/healthz"
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + probe, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server at {self.url} not {probe} within 120 s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(rec, popularity=None, **kw) -> LiveServer:
    policy_keys = {"unknown_items", "timestamp_order", "max_body_bytes", "max_candidates", "cold_start", "warmup", "exclude_history"}
    policy = ServePolicy(**{k: v for k, v in kw.items() if k in policy_keys})
    cfg = ServeConfig(**{"buckets": BUCKETS, **{k: v for k, v in kw.items() if k not in policy_keys}})
    return LiveServer(create_app(cfg, rec, policy=policy, popularity=popularity))


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kw)


async def _gather(url: str, path: str, bodies: list) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=len(bodies))) as c:
        return await asyncio.gather(*(c.post(path, json=b) for b in bodies))


def gather(url: str, path: str, bodies: list) -> list[httpx.Response]:
    """POST every body at once (one connection each); responses in order."""
    return asyncio.run(_gather(url, path, bodies))


def events(df: pd.DataFrame, user: int, n: int | None = None) -> list[dict]:
    rows = df[df.user == user]
    rows = rows if n is None else rows.iloc[:n]
    return [{"item_id": int(i), "timestamp": int(t)} for i, t in zip(rows.item, rows.ts)]


def direct(ref: Recommender, hist: list[dict], k: int, **kw) -> list[dict]:
    prep = ref.prepare(History([e["item_id"] for e in hist], [e["timestamp"] for e in hist]))
    return ref.recommend([prep], k, **kw)[0]


def _dense(ref: Recommender) -> dict:
    """Original id -> dense id straight from the id map (the reference does not use the Recommender's lookup)."""
    return {r: i for i, r in enumerate(ref.raw_ids.tolist()) if i > 0}


def user_vector64(ref: Recommender, hist: list[dict]) -> torch.Tensor:
    """The history's user vector from a float64 copy of the model on the unpadded (1, L + 1) sequence."""
    m = copy.deepcopy(ref.model).double()
    ids = torch.tensor([[_dense(ref)[e["item_id"]] for e in hist] + [0]])
    ts = torch.tensor([[e["timestamp"] for e in hist] + [hist[-1]["timestamp"]]])
    L = torch.tensor([len(hist)])
    with torch.no_grad():
        return m.last_rows(m.encode(ids, ts, L), L)[0]


def score64(ref: Recommender, user: torch.Tensor, raw_items: list[int]) -> np.ndarray:
    w = ref.model.item_emb.weight.detach().double()
    e = w[[_dense(ref)[i] for i in raw_items]]
    e = e / e.norm(dim=1, keepdim=True)
    return (e @ user / ref.model.cfg.temperature).numpy()


# ----------------------------------------------------------------------------------------------
# probes, docs, metrics names
# ----------------------------------------------------------------------------------------------
