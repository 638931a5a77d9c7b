"""``pilab trace RUN_DIR``: read a run's trace (``pilab.trace.read``) and draw it (``pilab.plots.run``).

    python -m pilab trace runs/x                     # the table; writes runs/x/trace.html
    python -m pilab trace runs/x --top 10 --step 40 --png runs/x/step40.png
    python -m pilab trace runs/pi48/predicted.json   # a trace file: writes runs/pi48/predicted.html
"""
from __future__ import annotations

import os


def add_parser(sub) -> None:
    """Register ``python -m pilab trace``."""
    p = sub.add_parser("trace", help="read a trace: straggler table, critical path, swim-lane page",
                       description="Per rank step time, compute, exposed network, waiting for a peer and "
                                   "data; the slowest steps and who made each slow; the critical path of "
                                   "the median step. Writes a zoomable swim-lane page beside the trace "
                                   "(RUN_DIR/trace.html, or the trace file's name with .html).")
    p.add_argument("run", metavar="RUN_DIR", help="a run directory holding trace.json, or a trace file")
    p.add_argument("--top", type=int, default=5, help="slowest steps to list (default: %(default)s)")
    p.add_argument("--step", type=int, default=None,
                   help="the step for the critical path and --png (default: the median step)")
    p.add_argument("--png", default=None, help="also draw that step as a static PNG (and .svg beside it)")
    p.set_defaults(func=run_trace)


def run_trace(args, argv) -> int:
    from ..trace import format as tf
    from ..trace import analyse, load, report
    from .common import UsageError

    if args.top < 0:
        raise UsageError(f"--top {args.top} must be >= 0")
    if args.png and not args.png.lower().endswith(".png"):
        raise UsageError(f"--png {args.png}: name a .png file (the .svg is written beside it)")
    if args.png:
        try:
            import matplotlib  # noqa: F401  (checked before anything is written)
        except ImportError:
            raise UsageError("--png needs matplotlib: pip install matplotlib (or leave --png out)") from None
    try:
        doc = load(args.run)
        a = analyse(doc, top=args.top, step=args.step)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    except tf.TraceError as e:
        raise UsageError(f"{args.run}: not a pilab trace ({e})") from None
    except ValueError as e:  # --step names a step the trace does not hold
        raise UsageError(f"--step {args.step}: {e}") from None
    from ..plots import run as tp

    print(report(a))
    html = os.path.join(args.run, "trace.html") if os.path.isdir(args.run) \
        else os.path.splitext(args.run)[0] + ".html"
    source = os.path.join(args.run, "trace.json") if os.path.isdir(args.run) else args.run
    print(f"\nwrote {tp.write_html(doc, html, f'pilab trace: {args.run}')} (or open {source} in "
          f"ui.perfetto.dev)")
    if args.png:
        print(f"wrote {tp.write_step_png(doc, a['critical']['step'], args.png)}")
    return 0
