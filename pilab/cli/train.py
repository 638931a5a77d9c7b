"""``pilab train``: synchronous data-parallel training over MPI.

    python -m pilab train --np 2 --epochs 2            # launches mpiexec itself
    mpiexec -n 2 python -m pilab train --epochs 2      # every rank runs this command

Ctrl-C or SIGTERM: every rank stops after the same step, result.json says ``stopped_early``, the exit
code is 128 + the signal (130, 143); a second one exits at once. A checkpoint or result that cannot be
written: one line, exit 74, the earlier files intact. ``--out`` holding another run: refused (exit 2)
unless ``--overwrite``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from .. import engine
from ..config import Config, ConfigError
from ..engine import exit_code_for, handled, interruptible
from ..launch import pilab_command, under_mpi
from .common import (EXIT_USAGE, UsageError, add_config_arguments, add_launch_arguments, batch_text, check_out_dir,
                     clear_out_dir, config_from_args, mpi_or_error, progress_callbacks, strip_flags)

DEFAULTS = Config(out="runs/train")


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="synchronous data-parallel training over MPI",
                       description="Train one model on np MPI ranks. Under mpiexec, every rank runs "
                                   "this command; with --np N it launches mpiexec itself.")
    t.add_argument("--np", type=int, default=None,
                   help="launch this many MPI ranks with mpiexec (omit under your own mpiexec)")
    add_launch_arguments(t, what="the ranks of --np")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--overwrite", action="store_true",
                   help="replace another run's results in --out (default: refuse; the same settings "
                        "again are a re-run and replace them)")
    t.add_argument("--hang-s", type=float, default=None,
                   help="end the job, naming the unreachable or stuck rank, after this many seconds "
                        "without a step on a rank (default: $PILAB_HANG_S or 120; 0: never; see "
                        "pilab.engine.watchdog)")
    t.add_argument("--node-memory", default="host",
                   help="memory of one node, for the warning before launch when ranks per node x the "
                        "predicted peak per rank (pilab.engine.memory) exceed it: pi4b_4gb, pi4b_8gb, host "
                        "(this machine's MemTotal; the default) or a size such as 4GB")
    t.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks that share one node's memory, for that warning (default: with --np all "
                        "of them, as they run on this machine; under mpiexec the ranks MPI puts on "
                        "rank 0's node)")
    add_config_arguments(t, DEFAULTS)
    t.set_defaults(func=run)


def _check_memory_flags(args) -> None:
    from ..engine import node_bytes
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        raise ConfigError(f"--ranks-per-node {args.ranks_per_node} must be >= 1")
    node_bytes(args.node_memory)


def _memory_warning(cfg: Config, args, np_: int, ranks_per_node: int) -> None:
    """One line on stderr when ``ranks_per_node`` ranks of ``cfg`` are predicted not to fit in
    ``--node-memory``; the run goes on (the prediction is within ~15%, see pilab.engine.memory)."""
    from ..engine import memory
    line = memory.fit_warning(cfg, np_=np_, ranks_per_node=ranks_per_node,
                              node_bytes=memory.node_bytes(args.node_memory))
    if line:
        print(line, file=sys.stderr, flush=True)


def run(args, argv) -> int:
    if args.hostfile and args.np is None:
        raise UsageError("--hostfile goes with --np N (pilab then starts mpiexec); under your own mpiexec give "
                         "the hostfile to it (mpiexec -f FILE) instead")
    cfg = config_from_args(args, DEFAULTS)
    if not under_mpi():
        _check_memory_flags(args)
    if args.np is not None and not under_mpi():
        return _launch(cfg, args, argv)
    if not under_mpi():
        from ..engine import load_data
        ds = load_data(cfg)
        cfg.check_world(1, len(ds.y_train))
        from ..engine import ownmodel as preflight
        preflight.check_model(cfg)
        _memory_warning(cfg, args, 1, args.ranks_per_node or 1)
        if _check_output(cfg, args, 1):
            clear_out_dir(cfg.out)
        if cfg.resume:  # the data and model source the checkpoint was made with (exit 2 if they changed)
            from ..engine import check_unchanged
            check_unchanged(cfg, ds)
        with interruptible(mpi=False) as stop:
            result = _train_alone(cfg, args.quiet, stop, ds)
        return _report(result, cfg, stop.signum)
    return _train_rank(cfg, args)


def _check_output(cfg: Config, args, np_: int) -> bool:
    """Refuse an --out of another run and a checkpoint that cannot resume this one, before any work;
    True when the old run files in --out are to be replaced."""
    stale = check_out_dir(cfg, overwrite=args.overwrite)
    if cfg.resume:
        from ..engine import checkpoint
        checkpoint.load(cfg.resume, cfg, np_)
    return stale


def _launch(cfg: Config, args, argv) -> int:
    """``--np N`` outside mpiexec: validate what can be checked before any rank starts, then launch.

    mpiexec runs in its own process group, so a Ctrl-C reaches it once, from here: the first asks the
    ranks to stop after their step, a second makes mpiexec end them at once."""
    from .. import data
    if args.np < 1:
        raise ConfigError(f"--np {args.np} must be >= 1")
    # the count alone (the cache's labels): the ranks load the images themselves
    cfg.check_world(args.np, data.train_size(cfg.data, train_subset=cfg.train_subset,
                                             test_subset=cfg.test_subset, seed=cfg.seed,
                                             image_size=cfg.image_size))
    mpi_or_error()
    from ..engine import ownmodel as preflight
    preflight.check_model(cfg, mpi=True)  # your own model on your data: before any rank starts
    _check_output(cfg, args, args.np)
    _memory_warning(cfg, args, args.np, args.ranks_per_node or _ranks_per_host(args))
    cmd = pilab_command(args.np, ["train", *strip_flags(argv, ("--np", "--mpiexec", "--hostfile"))],
                        mpiexec=args.mpiexec, hostfile=args.hostfile)
    print("launching: " + " ".join(cmd), file=sys.stderr, flush=True)
    # stdin from /dev/null: a launcher outside the terminal's foreground group must not read it
    # stdout/stderr through the watchdog's pump: it ends an mpiexec left waiting for a lost node
    # the ranks need not check the memory again (PILAB_MEMORY_CHECKED): it was done here, before launch
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, process_group=0, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PILAB_MEMORY_CHECKED="1"))
    got: list[int] = []

    def forward(signum, frame):
        got.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)
    with handled((signal.SIGINT, signal.SIGTERM), forward):
        from ..engine import watch_launcher
        t_launch, tail = time.time(), [""]
        rc = watch_launcher(proc, tail=tail)
        if rc != 0 and cfg.out:
            _keep_after_launcher(cfg, args.np, rc, tail[0], t_launch)
        # A second signal makes mpiexec end the ranks at once, and Hydra may then exit 0 although the
        # run did not finish: report the signal (128 + it), as a single process does.
        return exit_code_for(got[-1]) if len(got) >= 2 and rc == 0 else rc


def _ranks_per_host(args) -> int:
    """Ranks on the fullest host of ``--np`` ranks: all of them here, or as ``--hostfile`` places them --
    in order up to each host's slots, and round again past the last (as Hydra does). A hostfile that cannot
    be read is a UsageError, before anything starts."""
    if not args.hostfile:
        return args.np
    from ..launch.hosts import HostsError, read_hostfile
    try:
        hosts = read_hostfile(args.hostfile)
    except HostsError as e:
        raise UsageError(f"--hostfile: {e}") from None
    rounds = -(-args.np // sum(s for _, s in hosts))
    return min(args.np, rounds * max(s for _, s in hosts))


def _keep_after_launcher(cfg: Config, np_: int, rc: int, said: str, t_launch: float) -> None:
    """mpiexec failed and no rank wrote result.json (a node's processes killed, a node powered off: the
    launcher ends the others with SIGKILL): keep what the last checkpoint says was done."""
    from .. import resultfile
    from ..engine import result_from_checkpoint
    path = os.path.join(cfg.out, "result.json")
    if os.path.exists(path) and os.path.getmtime(path) >= t_launch:
        return  # rank 0 kept it (watchdog, an exception, a signal): it knows more
    last = next((x.strip() for x in reversed(said.splitlines()) if x.strip()), "")
    reason = (f"the job ended (mpiexec exit {rc}) before rank 0 could write its result: a rank was killed "
              f"or its node went away" + (f"; mpiexec said last: {last[:200]}" if last else ""))
    try:
        resultfile.save(result_from_checkpoint(cfg, np_, reason), path)
    except OSError:
        pass  # the launcher's exit code still says the job failed


def _train_alone(cfg: Config, quiet: bool, stop=None, data=None) -> dict:
    """One process without mpiexec: no MPI library needed."""
    from ..engine import Keeper
    return engine.train(cfg, None, callbacks=progress_callbacks(quiet), stop=stop, data=data, keeper=Keeper())


def _train_rank(cfg: Config, args) -> int:
    """One rank of an mpiexec job: the settings checked on every rank and voted on, then the guarded
    run (``pilab.engine.harness``); a finished run ends the process with its exit code
    (``harness.end_rank``), a refused one returns it."""
    from ..launch import mpi
    MPI = mpi()  # LaunchError naming the fix without an MPI library

    from ..engine import harness
    comm = MPI.COMM_WORLD

    def also(cfg_):  # pilab train's own checks, on every rank before the vote
        if args.np is not None and args.np != comm.Get_size():
            raise ConfigError(f"--np {args.np} but this job has {comm.Get_size()} ranks; "
                              "drop --np under mpiexec")

        _check_memory_flags(args)  # a bad --node-memory fails here, on every rank
        # only rank 0 writes: its view of --out and of the checkpoint counts
        return _check_output(cfg_, args, comm.Get_size()) if comm.Get_rank() == 0 else False
    try:
        cfg, data, hang_s, stale = harness.prepare(comm, lambda: cfg, args.hang_s, also=also,
                                                   refusals=(UsageError,))
    except harness.Refused as e:
        if e.speaks:  # the lowest failing rank speaks for all
            print(f"pilab: error: {e.error}", file=sys.stderr)
        return EXIT_USAGE
    local = _ranks_on_my_node(comm)  # collective, after the vote: every rank takes part
    if comm.Get_rank() == 0 and not os.environ.get("PILAB_MEMORY_CHECKED"):
        _memory_warning(cfg, args, comm.Get_size(), args.ranks_per_node or local)
    if stale:
        clear_out_dir(cfg.out)
    out = harness.guarded_run(cfg, comm, data=data, callbacks=progress_callbacks(args.quiet), hang_s=hang_s)
    harness.end_rank(_report(out.result, cfg, out.signum, speak=comm.Get_rank() == 0))


def _ranks_on_my_node(comm) -> int:
    """Ranks of ``comm`` sharing this rank's node (MPI's shared-memory split; collective)."""
    from ..launch import mpi
    node = comm.Split_type(mpi().COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def _report(result: dict, cfg: Config, signum: int | None = None, *, speak: bool = True) -> int:
    """Print the summary (rank 0 only: ``speak``) and return the exit code (``harness.exit_code``): 0;
    74 when a checkpoint or the result could not be written; 128 + the signal when stopped by one (130
    when another rank's signal or a stop request ended the run)."""
    from ..engine import exit_code
    write_error = result.get("write_error")
    if speak:
        last = result["epochs"][-1] if result["epochs"] else {}
        print(f"np={result['np']} threads/rank={result['threads']} {batch_text(result)} "
              f"wall {result['wall_time']:.1f}s  {result['images_per_s'] or 0:.0f} img/s  "
              f"final test acc {last.get('test_acc')}")
        if cfg.out and not (write_error and "result.json" in write_error):
            print(f"result: {os.path.join(cfg.out, 'result.json')}")
        if write_error:
            print(f"pilab: error: {write_error}", file=sys.stderr)
        elif result.get("stopped_early"):
            print(interrupted_line(result, cfg), file=sys.stderr)
    return exit_code(result, signum)


def interrupted_line(result: dict, cfg: Config) -> str:
    """One line: where the run stopped, what it kept, how to continue."""
    from ..engine import checkpoint
    ck = checkpoint.latest(cfg.out) if cfg.out else None
    return (f"pilab: {result.get('stop_reason') or 'stopped early'}: stopped after step "
            f"{result['steps_done']} of {result['total_steps']} ({result['epochs_done']} of "
            f"{result['config']['epochs']} epochs done)"
            + (f"; kept {os.path.join(cfg.out, 'result.json')} (stopped_early)" if cfg.out else "")
            + (f"; continue with `--resume {ck}`" if ck else ""))
