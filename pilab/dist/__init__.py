"""Communication for data-parallel training over MPI, in three levels as Horovod's torch package has them:
the primitives (``comm``: ``allreduce_``, ``broadcast_``, ``world``, the named ``Slots`` of per-step values,
the exact arithmetic MPI ranks and the simulator share), the helpers built on them (``helpers``:
parameters, optimizer state and BatchNorm buffers broadcast or settled), and ``GradSync`` -- fused,
overlapped gradient averaging for a training loop of your own, as ``hvd.DistributedOptimizer`` is for
Horovod's users (``gradsync``; its bucket rule ``buckets``, shared with the performance model; the
``Codec`` each bucket travels through, ``codec``: ``Config.compression``) -- with
SyncBatchNorm over MPI ranks on CPU (``syncbn``). Importing it imports nothing; each name loads its
module on first use::

    from mpi4py import MPI
    from pilab.dist import GradSync, broadcast_module_
    broadcast_module_(model, MPI.COMM_WORLD)
    sync = GradSync(model, MPI.COMM_WORLD, bucket_mb=1.0)
    sync.backward(loss); sync.finish(); optimizer.step()
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "comm": ["MPI", "world", "allreduce_", "broadcast_", "mpi_buffer", "Slots", "share_of_mean", "squared_norm",
             "wait_polling", "SPIN_S", "SPIN_BYTES_PER_S", "SLEEP_S"],
    "helpers": ["broadcast_module_", "broadcast_optimizer_state_", "bn_buffers", "sync_buffers_", "reduce_sums",
                "gather_floats", "abort_on_error", "LauncherError", "check_launcher"],
    "gradsync": ["GradSync", "StepComm"],
    "buckets": ["bucket_assignment"],
    "codec": ["Codec", "CODECS", "codec_for", "fp16_type"],
    "syncbn": ["SyncBatchNorm", "convert_sync_batchnorm", "per_channel"],
})
