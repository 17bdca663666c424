"""``hstu demo``: train the small preset on ML-1M, evaluate it on test, and show next-5 titles for three
users, in one command (README's first command)."""

from __future__ import annotations

import time
from pathlib import Path

from hstu import backend
from hstu.cli import NO_DATA, _run_data, default_data_dir, number_in
from hstu.config import SEED_MAX
from hstu.data.errors import plural


def add_demo_parser(sub) -> None:
    """The ``hstu demo`` subcommand."""
    d = sub.add_parser("demo", help="train on ML-1M, evaluate, and show next-5 titles for three users")
    d.add_argument("--data-dir", help="ML-1M directory holding ratings.dat (default: $HSTU_DATA_DIR, else ../shared/data/ml-1m)")
    d.add_argument("--epochs", type=number_in(int, 1), default=12, help="training epochs, >= 1 (default 12)")
    d.add_argument("--seed", type=number_in(int, 0, SEED_MAX), default=42, help="training seed (default 42)")
    d.add_argument("--out", default="runs/demo", help="run directory, replaced by each demo (default runs/demo)")
    d.add_argument("--device", default="cpu", help="auto, cpu, cuda or npu (default cpu)")
    d.add_argument("--threads", type=number_in(int, 0), default=0, help="torch threads (0: torch's default)")
    d.add_argument("--quiet", action="store_true", help="no per-batch progress bar")
    d.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    """Train the small preset on ML-1M, evaluate on test, show next-5 titles for 3 users."""
    from hstu.config import TrainConfig, model_config_from_preset
    from hstu.generate.recommend import Recommender
    from hstu.runs import claim_demo_dir, read_json
    from hstu.train.loop import DataSpec, fit

    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    if data_dir is None or not (data_dir / "ratings.dat").exists():
        raise FileNotFoundError(NO_DATA if data_dir is None else f"{data_dir}/ratings.dat not found. " + NO_DATA)
    backend.select(args.device)  # an unknown or absent device fails here, before the banner
    claim_demo_dir(out := Path(args.out))  # refuses a directory holding anything but an earlier demo
    t0 = time.perf_counter()
    print(f"hstu demo: training HSTU (small preset) on {data_dir} for {plural(args.epochs, 'epoch')} on {args.device} ...", flush=True)
    metrics = fit(
        out,
        model_config_from_preset("small"),
        TrainConfig(epochs=args.epochs, seed=args.seed, num_threads=args.threads),
        DataSpec("ml-1m", str(data_dir.resolve())),
        device=args.device,
        overwrite=True,  # each demo replaces the previous one in --out
        progress=not args.quiet,
    )
    t = metrics["test"]
    print(
        f"\ntest (full ranking over all items, {t['users']} users): HR@10 {t['HR@10']:.4f}  NDCG@10 {t['NDCG@10']:.4f}  "
        f"HR@50 {t['HR@50']:.4f}  MRR {t['MRR']:.4f}"
    )
    print(
        f"trained {plural(metrics['epochs'], 'epoch')} in {metrics['train_seconds']:.0f} s ({metrics['sequences_per_s']:.0f} sequences/s)\n"
    )
    from hstu.generate.batch import history_of

    rec = Recommender.from_run(out, args.device)
    log_ = _run_data(read_json(out / "config.json"), str(data_dir))[0]  # read once for the three users
    for user in (1, 2, 3):
        hist = history_of(log_, user)
        items = rec.recommend([rec.prepare(hist)], 5)[0]
        last = [rec.titles.get(str(i), str(i)) for i in hist.items[-3:]]
        print(f"user {user}: last watched: " + " | ".join(last))
        print("  next 5:      " + " | ".join(it.get("title", str(it["item_id"])) for it in items))
    print(f"\nrun directory: {out}   total {time.perf_counter() - t0:.0f} s")
    return 0
