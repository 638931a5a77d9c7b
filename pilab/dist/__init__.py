"""Communication for data-parallel training over MPI: the primitives (``comm``), the helpers built on them
(``helpers``: parameters, optimizer state and BatchNorm buffers broadcast or settled), ``GradSync`` (fused,
overlapped gradient averaging, ``gradsync``; its bucket rule ``buckets``) and SyncBatchNorm (``syncbn``).
"""
