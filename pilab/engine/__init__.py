"""The engine: the one training loop (``fit``, ``Session``) on a rank backend (``MPIRanks``, the
simulator's ``VirtualRanks``), its entry points, and what it is built from. Importing it imports nothing;
each name loads its module on first use::

    from mpi4py import MPI
    from pilab import engine
    result = engine.train(cfg, comm=MPI.COMM_WORLD)           # every rank of an MPI job (None: one process)
    result = engine.simulate(cfg, 48)                         # np=48 in this process (fast or exact: simulate_mode)
    result, model = engine.fit(cfg, engine.VirtualRanks(4))   # the loop itself, on any backend

``train`` and ``simulate`` return the result (every rank; rank 0 writes ``<out>/result.json``): the
config, environment, per-epoch metrics, per-step timings and peak memory per rank. ``components``: your
own (``pilab.Component``), beside the features the ``Config`` asks for. ``callbacks`` are called on rank 0
with event dicts (``kind`` = start | step | straggler | epoch | end); ``stop`` is polled on every rank each
step and any rank's True stops all ranks together after that step. ``model_fn``: your own model's
builder (a function taking num_classes), instead of ``cfg.model``.
"""
from .. import lazy


def train(cfg, comm=None, *, components=(), callbacks=(), stop=None, data=None, keeper=None,
          model_fn=None) -> dict:
    """Train ``cfg`` on all ranks of ``comm`` (None: one process); ``keeper`` (``Keeper``) writes what was
    done when the run cannot finish. ``mpiexec -n 2 python -m pilab train`` runs it on every rank."""
    from .loop import fit
    from .mpi import MPIRanks

    return fit(cfg, MPIRanks(comm), components=components, callbacks=callbacks, stop=stop, data=data,
               keeper=keeper, model_fn=model_fn)[0]


def simulate(cfg, np_: int, *, components=(), callbacks=(), stop=None, data=None, ranks_per_chunk: int = 0,
             model_fn=None) -> dict:
    """Emulate ``np_`` ranks training ``cfg`` in this process (``pilab.engine.virtual``): a result shaped
    like ``train``'s: an MPI run's numbers bit for bit with ``simulate_mode="exact"``, to float rounding in the
    ``fast`` mode that ``auto`` (the default) picks for most runs (docs/guide/simulate.md)."""
    from .loop import fit
    from .virtual import VirtualRanks

    return fit(cfg, VirtualRanks(np_, ranks_per_chunk), components=components, callbacks=callbacks, stop=stop,
               data=data, model_fn=model_fn)[0]


def check_supported(cfg, components=()) -> None:
    """Refuse (ConfigError) settings the simulator does not emulate exactly."""
    from .features import chosen
    from .virtual import VirtualRanks

    ranks = VirtualRanks(1)
    ranks.check(cfg, chosen(cfg, ranks, components))


__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "loop": ["fit", "Session", "Handoff"],
    "mpi": ["MPIRanks"],
    "virtual": ["VirtualRanks", "mode_used"],
    "backend": ["RankBackend", "StepResult", "base_model", "evaluate", "forward_loss", "load_data", "resolve_device",
                "environment", "peak_mem_mb", "NUM_CLASSES", "EVAL_BATCH"],
    "layers": ["virtual_state", "GhostBatchNorm2d", "use_ghost_batchnorm", "step_seed"],
    "records": ["Keeper", "failure_reason", "result_from_checkpoint", "RUN_FILES", "run_files"],
    "checkpoint": ["CheckpointError", "ReadError", "WriteError", "RESUMABLE", "check_unchanged"],
    "harness": ["guarded_run", "exit_code", "print_stragglers", "save_components", "EXIT_WRITE", "EXIT_REFUSED",
                "handled", "interruptible", "sigterm_as_interrupt", "exit_code_for"],
    "watchdog": ["watch_launcher", "hang_s_from_env", "DEFAULT_HANG_S", "EXIT_HANG"],
    "memory": ["predict_peak_bytes", "breakdown", "node_bytes", "fit_warning", "NODE_MEMORY", "free_bytes",
               "host_memory_bytes", "MemoryConfigError"],
    "ownmodel": ["with_model", "check_model", "check_rank_exact", "check_custom_model"],
    "optim": ["build_optimizer", "lr_at", "set_lr", "SubsetStep"],
    "features": ["FEATURES", "chosen"],
}, defined=["train", "simulate", "check_supported"])
