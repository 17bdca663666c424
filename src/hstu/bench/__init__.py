"""``hstu bench``: the reference port's benchmark table (P50 / P99 latency, QPS, memory, model bytes,
HR@10 per device x precision, the latency growth over history length) for a run on this machine.

Modules, bottom up:

- :mod:`hstu.bench.timing`: calls timed in interleaved rounds, latency statistics, host RSS peak;
- :mod:`hstu.bench.env`: the environment facts a result carries (device, driver / CUDA / CANN,
  torch and torch_npu versions, threads, load average, git commit);
- :mod:`hstu.bench.cells`: one measured column per precision (generation through
  :class:`hstu.generate.recommend.Recommender` and its engine, quality through
  :func:`hstu.train.evaluate.evaluate`, memory through the backend);
- :mod:`hstu.bench.load`: the HTTP load generator (open-loop Poisson steps, highest QPS with
  P99 <= 100 ms) that ``benchmarks/serve_load.py`` and ``benchmarks/soak.py`` also run;
- :mod:`hstu.bench.table`: Markdown / JSON output, ``--compare`` and the reference port's columns;
- :mod:`hstu.bench.plots`: PNG plots (matplotlib, the ``plot`` extra);
- :mod:`hstu.bench.cli`: the ``hstu bench`` subcommand.
"""
