"""Start MPI engines from a notebook, train on them with live metrics, stop them again.

Each ipyparallel engine is one MPI rank, so ``%%px`` cells and :meth:`Engines.train` run collectives
across them. The helper starts and stops a cluster only when asked to::

    from pilab.lab import cluster
    lab = cluster.start(n=2)                   # 2 engines = 2 ranks of one mpiexec (profiles/profile_mpi)
    lab                                        # rank -> engine id, host, pid, in rank order
    run = lab.train(cfg, np_=2, callbacks=[live])   # returns at once; rank 0's events reach `live`
    run.stop()                                 # every rank stops after its current step
    result = run.wait()                        # never hangs: a dead or stuck rank raises ClusterError
    lab.stop()

Or from a shell, then attach: ``ipcluster start --profile-dir profiles/profile_pi`` and
``lab = cluster.connect(profile="pi")``.

Stopping works on busy engines: the client asks each engine's nanny process (ipyparallel's per-engine
helper, reachable while the engine computes) to send SIGINT; while training, the engine's handler only
sets a flag (:func:`stop_flag`), which ``pilab.train`` polls every step and OR-reduces over the ranks, so
all ranks leave after the same step. A ``%%px`` cell interrupted from the notebook sends the same SIGINT.

Where things live (everything below is importable from ``pilab.lab.cluster`` itself):

- :mod:`~pilab.lab.cluster.profiles`: profiles, hostfiles, the LAN address; :func:`start` and :func:`connect`;
- :mod:`~pilab.lab.cluster.client`: :class:`Engines` (the notebook side), :class:`Run`, :class:`LocalRun`
  (a run on them or in this kernel, its failures);
- :mod:`~pilab.lab.cluster.rank`: what runs inside each engine (:func:`whoami`, :func:`stop_flag`,
  :func:`engine_train`, :func:`rank_state`), and rank 0 sending each rank its data shard
  (:func:`scatter_shards`);
- :mod:`~pilab.lab.cluster.events`: rank 0's events to the notebook, both halves (:func:`publish` and its reader).

The launcher (``mpiexec``) is found by :func:`pilab.launch.find_mpiexec`.
"""
from ... import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "client": ["Engines", "Run", "LocalRun"],
    "events": ["publish"],
    "profiles": ["start", "connect", "profile_dir", "hostfile_slots", "lan_address", "non_loopback_addresses",
                "running_clusters", "stop_stale"],
    "rank": ["ClusterError", "whoami", "stop_flag", "StopFlag", "engine_train", "rank_state", "RankTable", "last", "scatter_shards",
            "load_scattered"],
})
