"""The ``hstu train`` command: its parser and handler, one for single-process and distributed training.

``hstu train ARGS`` trains in this process; ``hstu train --distributed ARGS`` (started by torchrun,
or as a world of one without it) and ``python -m hstu.train ARGS`` (:mod:`hstu.train.__main__`, the
same as ``hstu train --distributed ARGS``) run the same recipe, :func:`hstu.train.loop.fit`, with
:class:`hstu.train.distributed.DistributedStrategy`. So the flags, defaults, help and errors are
the same: the distributed-only flags are this parser's argument group "distributed". :mod:`hstu.cli`
adds the command to ``hstu`` and turns the errors a user can fix into one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from hstu.cli import EXCLUDE_HISTORY_HELP, NO_DATA, default_data_dir, number_in
from hstu.config import ARCHITECTURES, NEGATIVES_MAX, SEED_MAX
from hstu.train.recipe import check_recipe
from hstu.train.recipe_flags import RECIPE_FIELDS, add_recipe_flags

log = logging.getLogger("hstu")


def add_train_parser(sub) -> None:
    """``hstu train``; ``python -m hstu.train`` parses with it too (as ``hstu train --distributed``)."""
    t = sub.add_parser("train", help="train a model on a data set")
    t.add_argument(
        "--dataset",
        help="ml-100k | ml-1m | ml-10m | ml-20m | ml-25m | ml-latest | ml-latest-small | amazon | sequences | taobao | retailrocket | csv "
        "(default ml-1m; with --resume: the run's)",
    )
    t.add_argument("--data-dir", help="data directory or file (default: $HSTU_DATA_DIR or ../shared/data/ml-1m)")
    t.add_argument(
        "--preset",
        choices=["small", "large", "prod"],
        help="model size and block (default small; with --resume only the run's own: see docs/configuration.md)",
    )
    t.add_argument("--config", help="TOML/JSON with [model], [train] and [data] tables; [model]'s fields apply over the --preset's values")
    t.add_argument(
        "--arch",
        choices=list(ARCHITECTURES),
        help="model architecture: hstu (default) or the SASRec baseline (Kang & McAuley 2018), at the --preset's sizes "
        "(or the --config [model] table's); not with --resume",
    )
    t.add_argument("--epochs", type=number_in(int, 1))
    t.add_argument(
        "--batch-size", type=number_in(int, 1), help="sequences per step (under --distributed: the global batch, split over the ranks)"
    )
    t.add_argument("--learning-rate", type=number_in(float, 0, lo_open=True))
    t.add_argument("--num-negatives", type=number_in(int, 1, NEGATIVES_MAX), help="uniform negatives per position (default 128)")
    add_recipe_flags(t)
    t.add_argument("--out", required=True, help="run directory")
    t.add_argument("--max-users", type=number_in(int, 1), help="use only the first N users (>= 1)")
    t.add_argument("--seed", type=number_in(int, 0, SEED_MAX), help=f"training seed in 0..{SEED_MAX} (default 42)")
    t.add_argument("--device", default="cpu", help="auto | cpu | cuda | npu (under --distributed rank r uses index LOCAL_RANK)")
    t.add_argument(
        "--protocol",
        choices=["clean", "paper"],
        help="(default clean; with --resume: the run's) clean: train/valid/test = all but last 2 / 2nd-to-last / last; "
        "paper: all but last / last",
    )
    t.add_argument("--skip-bad-rows", action="store_true", help="skip malformed rows (the count is reported)")
    add_loader_flags(t)
    _add_feature_flags(t)
    t.add_argument("--exclude-history", action=argparse.BooleanOptionalAction, help=EXCLUDE_HISTORY_HELP)
    t.add_argument(
        "--items",
        metavar="FILE",
        help="item metadata (.csv / .tsv / .parquet with a header; id column item_id, item or id; any other columns, e.g. "
        "title, category), copied into the run: shown by hstu generate, returned by the HTTP API",
    )
    r = t.add_mutually_exclusive_group()
    r.add_argument("--resume", action="store_true", help="continue the run in --out from its last epoch")
    r.add_argument("--overwrite", action="store_true", help="train afresh in an --out that already holds a run (deletes that run)")
    t.add_argument("--quiet", action="store_true", help="no progress (a bar on a terminal, a few log lines otherwise)")
    t.add_argument(
        "--max-minutes",
        type=number_in(float, 0, lo_open=True),
        help="stop after the epoch during which M minutes of wall time have passed (committed; continue with --resume); "
        "metrics.json status says why it stopped",
    )
    t.add_argument("--tensorboard", metavar="DIR", help="also write epoch scalars for TensorBoard to DIR (pip install 'hstu[tensorboard]')")
    from hstu.train.dist_setup import SHARDING_TYPES

    d = t.add_argument_group("distributed", "TorchRec-sharded item table, DDP dense layers (hstu.train.distributed)")
    d.add_argument(
        "--distributed",
        action="store_true",
        help="start with torchrun --nproc-per-node N --no-python hstu train --distributed ... (or torchrun ... -m hstu.train ...)",
    )
    d.add_argument(
        "--sharding", choices=list(SHARDING_TYPES), help="TorchRec layout of the item table (default row_wise; with --resume: the run's)"
    )
    t.set_defaults(func=cmd_train)


def add_loader_flags(p, run: bool = False) -> None:
    """``--columns`` / ``--format``, the loader options (DataSpec.options) of ``hstu train`` and, with
    ``run``, of ``hstu eval`` / ``hstu generate``, where they default to the run's
    (:func:`run_loader_options`)."""
    tail = " (default: the run's; a different value is an error)" if run else ""
    p.add_argument("--columns", help="csv columns by name or 0-based position, e.g. user=uid,item=iid,time=ts (no time: order-only)" + tail)
    p.add_argument("--format", help="csv file format, e.g. sep=;,header=none (sep: a character or tab|comma|semicolon|pipe|space)" + tail)


def _add_feature_flags(t) -> None:
    """``--feature COL`` / ``--numeric-feature COL:BUCKETS`` (repeatable; hstu.data.features)."""
    t.add_argument(
        "--feature",
        dest="features",
        action="append",
        metavar="COL",
        help="csv: a categorical side-feature column summed into the token (e.g. brand; repeatable; [data] features)",
    )
    t.add_argument(
        "--numeric-feature",
        dest="numeric_features",
        action="append",
        metavar="COL:BUCKETS",
        help="csv: a numeric column bucketised into BUCKETS quantile buckets of the training events (e.g. price:10; repeatable; "
        "[data] numeric_features)",
    )


def cmd_train(args) -> int:
    """``hstu train`` and ``hstu train --distributed`` / ``python -m hstu.train`` (torchrun): one recipe,
    :func:`hstu.train.loop.fit`, with the distributed strategy under --distributed; rank 0 prints metrics.json.
    --out is held for the whole command (:func:`hstu.runs.training_lock`; rank 0 under torchrun)."""
    from contextlib import nullcontext

    from hstu.runs import training_lock

    if not str(args.out).strip():
        raise ValueError("--out is empty: name the run directory")
    with training_lock(Path(args.out)) if not torchrun_rank(args) else nullcontext():
        return _train(args)


def _train(args) -> int:
    _check_out_dir(args)
    _check_resume_flags(args)
    _config_data(args)
    saved = _resume_defaults(args)
    from hstu.config import TrainConfig, load_config_tables, train_config_from_dict
    from hstu.data.prepare import absolute_data_dir
    from hstu.train.loop import DataSpec, fit

    data_dir = args.data_dir or default_data_dir()
    if data_dir is None:
        raise FileNotFoundError(NO_DATA)
    mcfg, tcfg = _model_cfg(args)
    if "train" in saved:  # the run's settings, then a --config [train] table's fields, then flags
        given = load_config_tables(args.config).get("train", {}) if args.config else {}
        tcfg = train_config_from_dict({**saved["train"], **given}, saved=True)  # fields it lacks: the old defaults
    tcfg = tcfg or TrainConfig()
    for name in RECIPE_FIELDS:
        if getattr(args, name, None) is not None:
            setattr(tcfg, name, getattr(args, name))
    if not args.distributed:  # under --distributed the flags choose FBGEMM's optimizer (_distributed_strategy)
        _local_table_flags(args, tcfg, saved.get("train"))
    if args.resume:
        _check_resume_epochs(Path(args.out), tcfg.epochs)
    repeat_window = saved.get("model", {}).get("repeat_window", mcfg.repeat_window)
    check_recipe(tcfg, repeat_window, args.distributed, saved.get("train"), Path(args.out) / "config.json")  # before the data is read
    spec = DataSpec(
        args.dataset,
        absolute_data_dir(data_dir),  # absolute: the run is read from any directory later
        args.protocol,
        args.max_users,
        args.skip_bad_rows,
        _data_options(args),
        exclude_history=args.exclude_history,
        items=str(Path(args.items).resolve()) if args.items else None,
    )
    strategy = _distributed_strategy(args, saved.get("distributed", {})) if args.distributed else None
    metrics = fit(
        args.out,
        mcfg,
        tcfg,
        spec,
        device=args.device,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.quiet,
        strategy=strategy,
        max_minutes=args.max_minutes,
        tensorboard=args.tensorboard,
    )
    if not torchrun_rank(args):
        print(json.dumps(metrics, indent=2))
    return 0


def _check_resume_epochs(run: Path, epochs: int) -> None:
    """ValueError when --resume asks for fewer epochs than ``run`` has committed (its last commit; they cannot be
    undone); with exactly that many, the log says there is nothing to train (the run is evaluated and reported again)."""
    from hstu.runs import has_train_state, read_manifest

    done = read_manifest(run)["epoch"] if has_train_state(run) else 0  # the commit, not its copy history.json (repaired from it)
    if epochs < done:
        raise ValueError(
            f"--resume: {run} has committed {done} epochs and --epochs {epochs} is fewer (epochs cannot be undone): "
            f"give --epochs above {done} to train on, or evaluate the run with hstu eval --run {run}"
        )
    if epochs == done:
        log.info(
            "--resume: %s has trained its %d epochs, nothing to train (--epochs above %d trains on); evaluating it again", run, done, done
        )


def torchrun_rank(args) -> int:
    """This process's torchrun RANK under --distributed, else 0."""
    from hstu.train.dist_setup import _env_int

    return _env_int("RANK", 0) if getattr(args, "distributed", False) else 0


def _distributed_strategy(args, saved: dict):
    """The --distributed strategy from the group's flags, those not given from the --config file's
    ``[train] table_optimizer / table_learning_rate``, then the resumed run's config.json ``distributed``
    table (``saved``), then the defaults; a missing TorchRec is an error a user can fix (exit 2). The
    config's local names: "rowwise_adagrad" is FBGEMM's too; "adamw" has no fused FBGEMM form (ValueError)."""
    from hstu.config import load_config_tables
    from hstu.train.dist_setup import TABLE_OPTIMIZERS, DistConfig

    given = load_config_tables(args.config).get("train", {}) if args.config else {}
    conf = given.get("table_optimizer")
    if args.table_optimizer is None and conf is not None and conf not in TABLE_OPTIMIZERS:
        raise ValueError(
            f"{args.config} [train] table_optimizer = {conf!r}: the distributed recipe trains the table with FBGEMM's fused "
            f"optimizers ({', '.join(TABLE_OPTIMIZERS)}; 'adamw' has none, FBGEMM's adam has no CPU kernel): set "
            "table_optimizer = 'rowwise_adagrad' or pass --table-optimizer"
        )
    opt = args.table_optimizer or conf or saved.get("table_optimizer", "rowwise_adagrad")
    if opt not in TABLE_OPTIMIZERS:
        raise ValueError(f"--table-optimizer {opt}: not an FBGEMM optimizer (--distributed); valid: {', '.join(TABLE_OPTIMIZERS)}")
    lr = args.table_learning_rate
    if lr is None and given.get("table_learning_rate") and opt == given.get("table_optimizer", "rowwise_adagrad"):
        lr = float(given["table_learning_rate"])  # the config's rate, for the optimizer it names (0: the default)
    if lr is None and opt == saved.get("table_optimizer"):
        lr = saved.get("table_learning_rate")
    try:
        from hstu.train.distributed import DistributedStrategy

        return DistributedStrategy(DistConfig(args.sharding or saved.get("sharding", "row_wise"), opt, lr))
    except ImportError as exc:
        raise ValueError(str(exc)) from None


def _local_table_flags(args, tcfg, saved: dict | None) -> None:
    """--table-optimizer / --table-learning-rate onto ``tcfg`` (one process): ValueError for an
    FBGEMM-only optimizer, a rate without rowwise_adagrad, or (``saved``: the resumed run's train
    table) another optimizer or rate than the run's (its saved optimizer state has the run's groups
    and rate)."""
    from hstu.config import LOCAL_TABLE_OPTIMIZERS

    opt = args.table_optimizer
    if opt is not None and opt not in LOCAL_TABLE_OPTIMIZERS:
        raise ValueError(f"--table-optimizer {opt}: FBGEMM's, only with --distributed; in one process: {', '.join(LOCAL_TABLE_OPTIMIZERS)}")
    if saved is not None and opt is not None and opt != saved.get("table_optimizer", "adamw"):
        raise ValueError(
            f"--resume: --table-optimizer is {opt!r} here but {saved.get('table_optimizer', 'adamw')!r} in the run "
            f"({Path(args.out) / 'config.json'} train.table_optimizer); its optimizer state is that optimizer's"
        )
    tcfg.table_optimizer = opt or tcfg.table_optimizer
    lr, was = args.table_learning_rate, (saved or {}).get("table_learning_rate", 0.0)
    if saved is not None and lr is not None and lr != was:  # the saved param groups carry the run's rate
        raise ValueError(
            f"--resume: --table-learning-rate is {lr:g} here but {was:g} in the run ({Path(args.out) / 'config.json'} "
            "train.table_learning_rate); the optimizer state resumes with the run's"
        )
    if args.table_learning_rate is not None:
        if tcfg.table_optimizer != "rowwise_adagrad":
            raise ValueError(
                f"--table-learning-rate {args.table_learning_rate:g} needs --table-optimizer rowwise_adagrad "
                f"(with {tcfg.table_optimizer} the table trains at --learning-rate)"
            )
        tcfg.table_learning_rate = args.table_learning_rate


def _model_cfg(args, say: bool = True):
    """(ModelConfig, TrainConfig or None): --preset (default small), --config [model] fields, --arch over it; errors name the file.
    ``say``: log a preset block option that gives way (once per command: the --resume check asks quietly)."""
    from hstu.config import PRESETS, load_config_file, load_config_tables, model_config_from_preset

    tcfg, fields, preset = None, {}, args.preset or "small"
    if getattr(args, "config", None):
        tcfg = load_config_file(args.config).get("train")  # every table checked, errors naming the file
        fields = load_config_tables(args.config).get("model", {})
    arch = {"architecture": args.arch} if getattr(args, "arch", None) else {}
    try:
        mcfg = model_config_from_preset(preset, **{**fields, **arch})
    except ValueError as exc:  # a [model] field that the preset or --arch cannot take: name the file too
        where = f"{args.config} [model]" + (f" with --arch {args.arch}" if arch else "")
        raise (ValueError(f"{where}: {exc}") if fields else exc) from None
    if say and PRESETS[preset].get("multi_channel") and not mcfg.multi_channel and "multi_channel" not in fields:
        given = "" if args.preset else " (the default)"
        log.info("--preset %s%s: multi_channel off (the multi-channel block needs hstu and a relative bias)", preset, given)
    return mcfg, tcfg


def _check_out_dir(args) -> None:
    """FileExistsError when --out holds a quantized copy, or a run without --resume or --overwrite; with --overwrite,
    ``fit`` replaces the old run once the new one commits an epoch (:mod:`hstu.train.replace`: a failed start loses nothing)."""
    from hstu.runs import RUN_FILES, is_quantized

    out = Path(args.out)
    if is_quantized(out):  # hstu quantize's output: nothing to resume; its INT8 weights would shadow a new model
        raise FileExistsError(f"--out {out} holds a quantized copy of a run (quant.json, from hstu quantize), not a run to train")
    found = [f for f in RUN_FILES if (out / f).exists()]
    if args.resume:
        return
    if not found:
        _check_foreign_files(out)
        return
    if not args.overwrite:
        raise FileExistsError(
            f"--out {out} already holds a run ({', '.join(found)}); pass --resume to continue it, "
            "--overwrite to replace it, or choose another --out"
        )
    log.warning("--overwrite: the run in %s (%s) is replaced once the new one commits an epoch", out, ", ".join(found))


def _check_foreign_files(out: Path) -> None:
    """FileExistsError when ``out`` holds a config.json / idmap.json / items.npz that no hstu run wrote (a training
    writes those names: another tool's file there would be overwritten, then deleted if the start fails). An hstu
    run's (its config.json has the model, train and data tables: a start that ended before its first epoch) is fine."""
    from hstu.runs import CONFIG, IDMAP, ITEMS

    present = [f for f in (CONFIG, IDMAP, ITEMS) if (out / f).exists()]
    if not present:
        return
    try:
        cfg = json.loads((out / CONFIG).read_text(encoding="utf-8"))
        ours = isinstance(cfg, dict) and {"model", "train", "data"} <= cfg.keys()
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise FileExistsError(
            f"--out {out} holds {', '.join(present)} that no hstu run wrote (training writes files of those names): "
            "choose another --out, or move them"
        )


def _check_resume_flags(args) -> None:
    """ValueError when --resume comes with a model choice that differs from the run's: the run continues its saved
    model (config.json), so --preset, --arch or a [model] table that sets another value than the run's would be
    silently ignored. The flags are taken together, as a new run takes them (:func:`_model_cfg`): the command that
    trained a run (``--preset large --config F``, ``--arch sasrec``), with --resume added, goes on."""
    if not args.resume:
        return
    path = Path(args.out) / "config.json"
    table = {}
    if args.config:
        from hstu.config import load_config_file, load_config_tables

        load_config_file(args.config)  # every table checked, errors naming the file
        table = load_config_tables(args.config).get("model", {})
    if not path.exists():  # no run there: _resume_defaults says so
        return
    arch, preset = getattr(args, "arch", None), args.preset
    wanted = dict(table)  # a table alone: its fields as written
    if arch or preset is not None:  # the model a new run would build from the flags together
        from hstu.config import PRESETS

        mcfg, _ = _model_cfg(args, say=False)
        keys = [*(PRESETS[preset] if preset is not None else ()), *table, *(["architecture"] if arch else [])]
        wanted = {k: getattr(mcfg, k) for k in keys}
    if not (diffs := _model_differs(wanted, path)):
        return
    diff = ", ".join(f"{k} = {json.dumps(v)} (the run: {json.dumps(r)})" for k, v, r in diffs)
    if not (arch or preset is not None):
        raise ValueError(f"--resume continues the run's saved model ({path}); {args.config} [model] sets {diff}: drop them")
    said = {k: f"{args.config}'s [model] {k}" for k in table} | {"architecture": f"--arch {arch}"}
    drop = dict.fromkeys(said.get(k, f"--preset {preset}") for k, _, _ in diffs)
    raise ValueError(f"--resume continues the run's saved model ({path}): the flags give {diff}; drop {', '.join(drop)}")


def _model_differs(values: dict, path: Path) -> list[tuple]:
    """(field, value, the run's value) for each of ``values`` ([model] fields) that the run's saved model at ``path``
    (config.json; fields it lacks: ModelConfig's defaults) holds otherwise."""
    from hstu.config import ModelConfig
    from hstu.model.checkpoint import read_json

    saved, default = read_json(path).get("model", {}), ModelConfig()
    run = {k: saved.get(k, getattr(default, k)) for k in values}
    return [(k, v, run[k]) for k, v in values.items() if run[k] != v]


def _resume_defaults(args) -> dict:
    """With --resume: the run's saved config.json ({"train": ..., "data": ...}), whose train
    settings and data options stand in for the flags not given (empty dict otherwise). The data
    flags left unset become the run's; flags given that contradict the run are refused by
    :func:`hstu.train.loop.fit`."""
    path = Path(args.out) / "config.json"
    if args.resume and not path.exists():
        raise FileNotFoundError(f"--resume: {args.out} holds no run to resume (no config.json); drop --resume to train a new run there")
    from hstu.data.prepare import data_dir_exists
    from hstu.model.checkpoint import read_json
    from hstu.model.run_files import IDMAP
    from hstu.train.loop import check_resume_data

    saved = read_json(path) if args.resume else {}  # checked field by field: a malformed one is named
    data = saved.get("data", {})
    ids = path.parent / IDMAP  # the run's data-set default (its exclude_history None) asked for explicitly: the same run
    if "exclude_history" in data and data["exclude_history"] is None and args.exclude_history is not None and ids.exists():
        args.exclude_history = None if args.exclude_history == read_json(ids).get("exclude_history_default") else args.exclude_history
    given = {"dataset": args.dataset, "protocol": args.protocol, "max_users": args.max_users}
    given |= {"options": _data_options(args) or None, "exclude_history": args.exclude_history}
    check_resume_data(path, data, {k: v for k, v in given.items() if v is not None})  # before any data is read
    args.dataset = args.dataset or data.get("dataset") or "ml-1m"
    args.protocol = args.protocol or data.get("protocol") or "clean"
    if args.max_users is None:
        args.max_users = data.get("max_users")
    if args.exclude_history is None:
        args.exclude_history = data.get("exclude_history")
    args.skip_bad_rows = args.skip_bad_rows or bool(data.get("skip_bad_rows", False))
    for k, v in data.get("options", {}).items():  # the run's loader options where neither a flag nor [data] gives one
        args.data_options.setdefault(k, v)
    if not args.data_dir and not os.environ.get("HSTU_DATA_DIR") and data.get("data_dir"):
        if data_dir_exists(data["data_dir"]):
            args.data_dir = data["data_dir"]
        elif args.dataset != "ml-1m":  # ml-1m: found where `hstu train` finds it; another data set: not silently ML-1M's
            raise FileNotFoundError(f"--resume: the run's {args.dataset} data {data['data_dir']} is not found; pass --data-dir")
    return saved


def _config_data(args) -> None:
    """The --config file's ``[data]`` table (:func:`hstu.config.data_spec_from_table`) as the values
    of the data flags not given (flags win); its loader options go to ``args.data_options``."""
    args.data_options = {}
    if not getattr(args, "config", None):
        return
    from hstu.config import load_config_file, load_config_tables

    spec, given = load_config_file(args.config).get("data"), load_config_tables(args.config).get("data", {})
    if spec is None:
        return
    for name in ("dataset", "data_dir", "protocol", "max_users", "exclude_history", "items"):
        if name in given and getattr(args, name, None) is None:
            setattr(args, name, getattr(spec, name))
    args.skip_bad_rows = args.skip_bad_rows or spec.skip_bad_rows
    args.data_options = dict(spec.options)


def _data_options(args) -> dict:
    """Loader options (DataSpec.options): the [data] table's / the run's, then --columns and --format."""
    flags = {k: getattr(args, k, None) for k in ("columns", "format")}
    for k in ("features", "numeric_features"):  # repeatable flags -> one comma text (hstu.data.features.parse_feature_options)
        if getattr(args, k, None):
            flags[k] = ",".join(getattr(args, k))
    return {**getattr(args, "data_options", {}), **{k: v for k, v in flags.items() if v}}


def run_loader_options(data: dict, args, config_path: Path) -> dict:
    """The loader options of a trained run for ``hstu eval`` / ``hstu generate``: the run's
    (config.json ``data.options``), with the --columns / --format given (:func:`_data_options`)
    checked against them; a run that recorded none takes the flags.

    Args:
        data: the run's config.json ``data`` table; args: the command's parsed flags;
        config_path: that config.json (named in the error).
    Returns the options for DataSpec.options (a new dict).
    Raises ValueError naming the flag, both values and the file where a flag's value differs from
    the run's (compared parsed, :func:`hstu.data.delimited.parse_format` / ``parse_columns``, so
    ``sep=tab`` equals ``sep=\\t``): the run's item ids and splits come from the data read its way.
    """
    given = _data_options(args)
    saved = data.get("options")
    if saved is None:
        return given
    for name, value in given.items():
        if not _same_option(name, value, saved.get(name), data.get("data_dir")):
            was = repr(saved[name]) if name in saved else "none (the loader's default)"
            raise ValueError(
                f"--{name} is {value!r} here but {was} in the run ({config_path} data.options.{name}); "
                "drop the flag (the run's is the default) or pass the run's value"
            )
    return dict(saved)


def _same_option(name: str, a, b, data_dir=None) -> bool:
    """Whether two values of loader option ``name`` read the data the same way (None: not given); a format's separator
    left to the loader is the one it takes for each of the run's files (``data_dir``: tab for .tsv, else comma)."""
    from hstu.data.delimited import log_files, parse_columns, parse_format

    if name == "format":
        fa, fb = parse_format(a), parse_format(b)
        try:
            paths = log_files(data_dir) if data_dir else [Path("log.csv")]
        except (OSError, ValueError):  # the run's data moved: its name alone
            paths = [Path(str(data_dir))]
        return fa.header == fb.header and all(fa.sep_for(p) == fb.sep_for(p) for p in paths)
    if name == "columns" and a is not None and b is not None:
        return parse_columns(a) == parse_columns(b)
    return a == b
