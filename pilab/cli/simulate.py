"""``pilab simulate --np N``: the same training as ``pilab train --np N``, with virtual ranks."""
from __future__ import annotations

import os

from ..config import Config, ConfigError
from .common import add_config_arguments, config_from_args, progress_callbacks

DEFAULTS = Config(out="runs/simulate")


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="emulate np ranks exactly in one process",
                       description="Run the same training as `pilab train --np N` would, in one "
                                   "process, with virtual ranks (CPU, or CUDA with bf16 autocast).")
    p.add_argument("--np", type=int, required=True, help="number of virtual ranks")
    p.add_argument("--ranks-per-chunk", type=int, default=0,
                   help="virtual ranks per forward pass (memory vs speed; default: ~256 images)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_arguments(p, DEFAULTS)
    p.set_defaults(func=run)


def run(args, argv) -> int:
    from .. import simulate
    cfg = config_from_args(args, DEFAULTS)
    if args.np < 1:
        raise ConfigError(f"--np {args.np} must be >= 1")
    res = simulate.run(cfg, args.np, callbacks=progress_callbacks(args.quiet),
                       ranks_per_chunk=args.ranks_per_chunk)
    last = res["epochs"][-1] if res["epochs"] else {}
    print(f"simulated np={args.np} global batch={res['global_batch']} peak lr={res['peak_lr']:.4g} "
          f"final test acc {last.get('test_acc')}")
    if cfg.out:
        print(f"result: {os.path.join(cfg.out, 'result.json')}")
    return 0
