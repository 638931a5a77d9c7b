"""The candidates of the fast-and-right study (issue 20): pilab's toolbox (``pilab.study.remedies.toolbox_candidates``: its
default remedies, then local SGD, the few-step recipe's pieces alone and together, BatchNorm over small groups,
batch-size ramps), at this study's protocol. They began here and moved into pilab so that an installed pilab
has them (``--candidates toolbox``); this file stays the study's record of what it ran::

    pilab remedies --candidates experiments/fast-but-wrong/remedies/candidates.py --np 48 --only "local SGD H=8"
    python experiments/fast-but-wrong/remedies/candidates.py       # the labels at the protocol, np=48

fast-and-right.sh runs them one point at a time; seeds_table.py names each point's folder by its label.
"""
from __future__ import annotations

from pilab import Config
from pilab.study.remedies import toolbox_candidates as candidates  # what --candidates reads
from pilab.study.toolbox import fast_and_right  # noqa: F401 (this study's own part of them)

# the protocol of fast-and-right.sh (15,000 images, 10 epochs, 32 per rank, lr 0.05 per 32)
PROTOCOL = Config(model="mobilenetv2_cifar", width=0.25, train_subset=15000, epochs=10, batch_size=32, lr=0.05,
                  lr_ref_batch=32)


if __name__ == "__main__":
    print("\n".join(label for label, _ in candidates(PROTOCOL, 48)))
