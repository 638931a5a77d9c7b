"""``pilab simulate --np N``: the same training as ``pilab train --np N``, with virtual ranks.

Ctrl-C or SIGTERM stops after the current step and writes result.json (``stopped_early``), exit 130 or
143; a second one exits at once. ``--out`` holding another run is refused unless ``--overwrite``."""
from __future__ import annotations

import os
import sys

from .. import engine
from ..config import Config, ConfigError
from ..engine import EXIT_WRITE, exit_code_for, interruptible
from .common import add_config_arguments, batch_text, check_out_dir, clear_out_dir, config_from_args, progress_callbacks

DEFAULTS = Config(out="runs/simulate")


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="np ranks' training in one process (its mode: --simulate-mode)",
                       description="Run the same training as `pilab train --np N` would, in one "
                                   "process, with virtual ranks (CPU, or CUDA with bf16 autocast).")
    p.add_argument("--np", type=int, required=True, help="number of virtual ranks")
    p.add_argument("--ranks-per-chunk", type=int, default=0,
                   help="virtual ranks per forward pass (memory vs speed; default: ~256 images)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true",
                   help="replace another run's results in --out (default: refuse)")
    add_config_arguments(p, DEFAULTS)
    p.set_defaults(func=run)


def run(args, argv) -> int:
    cfg = config_from_args(args, DEFAULTS)
    if args.np < 1:
        raise ConfigError(f"--np {args.np} must be >= 1")
    engine.check_supported(cfg)
    from ..engine import ownmodel as preflight
    preflight.check_model(cfg)  # your own model on your data: before any work
    if check_out_dir(cfg, overwrite=args.overwrite):
        clear_out_dir(cfg.out)
    with interruptible(mpi=False) as stop:
        res = engine.simulate(cfg, args.np, callbacks=progress_callbacks(args.quiet), stop=stop,
                           ranks_per_chunk=args.ranks_per_chunk)
    last = res["epochs"][-1] if res["epochs"] else {}
    print(f"simulated np={args.np} {batch_text(res)} peak lr={res['peak_lr']:.4g} "
          f"final test acc {last.get('test_acc')}")
    if cfg.out and "result.json" not in res.get("write_error", ""):
        print(f"result: {os.path.join(cfg.out, 'result.json')}")
    if res.get("write_error"):
        print(f"pilab: error: {res['write_error']}", file=sys.stderr)
        return EXIT_WRITE
    if res.get("stopped_early"):
        print(f"pilab: {res['stop_reason']}: stopped after step {res['steps_done']} of "
              f"{res['total_steps']} ({res['epochs_done']} of {cfg.epochs} epochs done)"
              + (f"; kept {os.path.join(cfg.out, 'result.json')} (stopped_early)" if cfg.out else ""),
              file=sys.stderr)
        return exit_code_for(stop.signum)
    return 0
