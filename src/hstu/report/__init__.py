"""``hstu report``: PNG training curves and a Markdown summary of one run or several side by side.

- :mod:`hstu.report.plots`: matplotlib (the ``plot`` extra) helpers: :func:`~hstu.report.plots.plot_curves`
  (one line per run, epoch -> value; also used by the benchmarks) and the atomic PNG write;
- :mod:`hstu.report.summary`: a run's facts read through :mod:`hstu.runs` and the Markdown;
- :mod:`hstu.report.cli`: the command.

Place in the import order: beside serve / ops / bench (reads runs; imports nothing above it but
:mod:`hstu.cli`'s argument helpers, lazily).
"""
