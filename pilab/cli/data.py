"""``pilab data {fetch,info,cache}``: get, inspect or uncache CIFAR-10."""
from __future__ import annotations

import os

from .common import UsageError


def add_parser(sub) -> None:
    d = sub.add_parser("data", help="fetch, inspect or uncache CIFAR-10",
                       description="fetch: download the official CIFAR-10 (needs torchvision and "
                                   "internet); info: load a source and show counts and checksum; "
                                   "cache: list the decoded data sets pilab keeps ($PILAB_CACHE), "
                                   "--clear to delete them.")
    d.add_argument("action", choices=("fetch", "info", "cache"))
    d.add_argument("--clear", action="store_true", help="with cache: delete the cached data sets")
    d.add_argument("--root", default=None, help="where fetch stores it (default: the pilab cache)")
    d.add_argument("--data", default="embedded", help="source for info (default: embedded)")
    d.set_defaults(func=run)


def run(args, argv) -> int:
    from .. import data
    if args.action == "fetch":
        path = data.fetch(args.root)
        print(f"CIFAR-10 python batches in {path}; use --data cifar10 (or --data {path})")
        return 0
    if args.clear and args.action != "cache":
        raise UsageError(f"--clear goes with `pilab data cache`, not `pilab data {args.action}`")
    if args.action == "cache":
        return _cache(data, args.clear)
    ds = data.load(args.data)
    print(f"source: {ds.source}\ntrain: {len(ds.y_train)}  test: {len(ds.y_test)}  "
          f"classes: {', '.join(ds.classes)}\nchecksum: {ds.checksum}\n"
          f"cache: {data.default_cache_dir()}")
    return 0


def _cache(data, clear: bool) -> int:
    entries = data.cache_entries()
    size_mb = sum(e["bytes"] for e in entries) / 1e6
    if clear:
        removed = data.clear_cache()
        print(f"removed {len(removed)} cached data set(s), {size_mb:.0f} MB, from {data.default_cache_dir()}")
        return 0
    print(f"cache: {data.default_cache_dir()} ({len(entries)} data set(s), "
          f"{size_mb:.0f} MB; `pilab data cache --clear` removes them)")
    for e in entries:
        print(f"{e['bytes'] / 1e6:8.1f} MB  {os.path.basename(e['path'])}  {e['source']}")
    return 0
