"""Image classification data for data-parallel training (CIFAR-10 by default, or your own: any classes,
size, grey or RGB): loading, caching, sharding across ranks, batched augmentation.

One process per rank calls the same functions; only the rank changes what it gets::

    from pilab import data
    ds = data.load("embedded")                    # shipped 5,000/1,000 subset; or "cifar10", or a path
    loader = data.ShardLoader(ds, np_=comm.size, rank=comm.rank, batch=32, seed=0, policy="static")
    for epoch in range(epochs):
        for step, x, y in loader.epoch(epoch):    # x float32 (B,3,32,32) channels_last, y int64 (B,)
            ...
    sl = data.test_shard(len(ds.y_test), comm.size, comm.rank)   # evaluate x_test[sl], reduce sums

Under ``mpiexec -n 4 python -m pilab train`` every rank sees the same shards and step counts, because all
randomness derives from (seed, epoch, step, rank) and never from global RNG state.

Sources for :func:`load` (decoded once, then cached as an ``.npz`` in :func:`default_cache_dir`):

- ``"embedded"``: the class-balanced subset shipped in ``pilab/embedded/`` (see its README);
- ``"cifar10"``: the official python batches placed in the cache by ``python -m pilab data fetch``;
- a path to the official ``cifar-10-batches-py`` directory (or its ``.tar.gz``), or to an ImageFolder
  directory / ``.tar.gz`` with ``train/<class>/*.jpg|png`` and ``test/<class>/*`` (any classes, any size:
  ``image_size=N`` resizes mixed sizes);
- a ``.npz`` written by :func:`save` from numpy arrays or torch Datasets (:mod:`~pilab.data.sources`).

Where things live (everything below is importable from ``pilab.data`` itself):

- :mod:`~pilab.data.dataset`: the :class:`CIFAR10` arrays and :class:`DataError`;
- :mod:`~pilab.data.sources`: :func:`load`, :func:`fetch`, each layout decoded, your arrays saved
  (:func:`from_arrays`, :func:`save`); :mod:`~pilab.data.cache` keeps the decoded arrays;
- :mod:`~pilab.data.shards`: subsets, shards, per-epoch batch indices, test slices (numpy only);
- :mod:`~pilab.data.loader`: :class:`ShardLoader`, one rank's batches, normalised and augmented (torch).
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "sources": ["load", "train_size", "describe", "from_arrays", "from_dataset", "save", "fetch", "BATCHES_DIR",
               "OFFICIAL_URL", "cached_counts", "resolve_source"],
    "cache": ["default_cache_dir", "cache_entries", "clear_cache", "resolve_cache_dir"],
    "dataset": ["CIFAR10", "CLASSES", "DataError", "CIFAR10_MEAN as MEAN", "CIFAR10_STD as STD"],
    "loader": ["PAD", "pad_for", "to_input", "augment", "ShardLoader", "ranks_batch"],
    "shards": ["POLICIES", "stratified_subset", "static_shards", "epoch_accounting", "epoch_batches", "test_shard",
              "batch_shares", "epoch_permutation"],
})
