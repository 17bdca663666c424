"""``python -m hstu.train ARGS``: distributed training, one process per device, started by torchrun;
the same command as ``hstu train --distributed ARGS`` (one parser: :mod:`hstu.train.cli`).

    torchrun --nproc-per-node 2 -m hstu.train --dataset ml-1m --data-dir DIR --preset small \\
        --epochs 10 --out RUN [--max-users N] [--sharding row_wise|column_wise|table_wise]

Without torchrun it trains as a world of one process. See :mod:`hstu.train.distributed`.
"""

import sys

from hstu.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "--distributed", *sys.argv[1:]]))
