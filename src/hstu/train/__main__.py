"""``python -m hstu.train``: distributed training, one process per device, started by torchrun.

    torchrun --nproc-per-node 2 -m hstu.train --dataset ml-1m --data-dir DIR --preset small \\
        --epochs 10 --out RUN [--max-users N] [--sharding row_wise|column_wise|table_wise]

Takes the options of ``hstu train`` plus ``--sharding``, ``--table-optimizer`` and
``--table-learning-rate``; see :mod:`hstu.train.distributed`.
"""

import sys

from hstu.train.distributed import main

if __name__ == "__main__":
    sys.exit(main())
