"""The commands' defaults fit a user's own data: `scale`, `remedies`, `simulate` and `train` on a data set
far smaller than the embedded demo's subsets run with nothing else given -- an ImageFolder of 500 images
(a slice of the real CIFAR-10 archive), arrays through ``data.from_arrays``, and sklearn's digits (1,797
8x8 grey images: the registered models' first layer takes the data's channels).

The demo's subsets (2,000 training and 1,000 test images) apply to the embedded data only; on any other
data every image is used (``config.demo``), and the default process counts that the data cannot hold (a
batch of 32 for each rank) give way to the most it can (``cli.common.fit_nps``), with one line saying so.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from conftest import mpi_env

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def _slice(archive: Path, train: int, test: int):
    """The first ``train`` and ``test`` JPEG bytes of each class of the real archive, by split and class."""
    want = {"train": train, "test": test}
    got = {(s, c): [] for s in want for c in CLASSES}
    with tarfile.open(archive, "r|gz") as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.isfile() and len(parts) >= 3 and (parts[-3], parts[-2]) in got:
                files = got[(parts[-3], parts[-2])]
                if len(files) < want[parts[-3]]:
                    files.append((parts[-1], tar.extractfile(m).read()))
                if all(len(v) >= want[k[0]] for k, v in got.items()):
                    break
    return got


@pytest.fixture(scope="module")
def folder(cifar_archive, tmp_path_factory):
    """An ImageFolder of 500 real CIFAR-10 images: 40 training and 10 test images of each class."""
    root = tmp_path_factory.mktemp("folder") / "five-hundred"
    for (split, cls), files in _slice(cifar_archive, 40, 10).items():
        (root / split / cls).mkdir(parents=True)
        for name, payload in files:
            (root / split / cls / name).write_bytes(payload)
    return root


@pytest.fixture(scope="module")
def arrays(cifar_archive, tmp_path_factory):
    """300 real CIFAR-10 images (24 + 6 a class) as numpy arrays through ``data.from_arrays``, saved."""
    from PIL import Image

    from pilab import data
    part = _slice(cifar_archive, 24, 6)

    def xy(split):
        items = [(k, np.asarray(Image.open(io.BytesIO(b)).convert("RGB")))
                 for k, cls in enumerate(CLASSES) for _, b in part[(split, cls)]]
        return np.stack([x for _, x in items]), np.array([k for k, _ in items])
    ds = data.from_arrays(*xy("train"), *xy("test"), classes=list(CLASSES))
    return data.save(ds, str(tmp_path_factory.mktemp("arrays") / "arrays.npz"))


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """sklearn's digits (1,797 8x8 grey images, 10 classes) through ``data.from_arrays``, saved."""
    load_digits = pytest.importorskip("sklearn.datasets").load_digits
    from pilab import data
    d = load_digits()
    x = (d.images * 16).clip(0, 255).astype("uint8")
    ds = data.from_arrays(x[:1500], d.target[:1500], x[1500:], d.target[1500:])
    return data.save(ds, str(tmp_path_factory.mktemp("digits") / "digits.npz"))


def _pilab(*args, cwd, timeout=900):
    return subprocess.run([sys.executable, "-m", "pilab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(PILAB_CACHE=str(Path(cwd) / "cache")))


def test_the_demo_subsets_are_the_embedded_data_s_only():
    from pilab.config import DEMO, demo
    assert demo() is DEMO and (DEMO.train_subset, DEMO.test_subset) == (2000, 1000)
    mine = demo("/data/mine")
    assert (mine.train_subset, mine.test_subset, mine.data) == (0, 0, "/data/mine")
    assert mine.epochs == DEMO.epochs and mine.width == DEMO.width  # the rest of the demo stays


def test_fit_nps_keeps_what_fits_and_adds_the_largest_that_does(capsys):
    from pilab.cli.common import fit_nps
    from pilab.config import DEMO
    assert fit_nps(DEMO, [8, 48], 2000, flag="--simulate-nps", command="scale") == [8, 48]
    assert capsys.readouterr().err == ""
    assert fit_nps(DEMO, [8, 48], 400, flag="--simulate-nps", command="scale") == [8, 12]  # 400 // 32
    err = capsys.readouterr().err
    assert "400 training images hold at most 12 ranks of 32 images: --simulate-nps 8,12 instead of " \
           "the default 8,48" in err and len(err.splitlines()) == 1
    assert fit_nps(DEMO, [48], 150, flag="--np", command="remedies") == [4]


@pytest.mark.mpi
def test_scale_with_defaults_runs_on_a_500_image_folder(folder, tmp_path):
    """The issue's done-when: `pilab scale --data FOLDER` and nothing else, on 500 images."""
    p = _pilab("scale", "--data", str(folder), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--simulate-nps 8,12 instead of the default 8,48" in p.stderr
    out = tmp_path / "runs" / "scale"
    runs = {int(p.parent.name[2:]): json.loads(p.read_text()) for p in out.glob("np*/result.json")}
    assert sorted(runs) == [1, 2, 8, 12]
    assert all(r["data"]["n_train"] == 400 and r["config"]["train_subset"] == 0 for r in runs.values())
    assert (out / "study.json").exists() and (out / "report.html").exists()


@pytest.mark.parametrize("kind", ["folder", "arrays", "digits"])
def test_train_simulate_and_remedies_defaults_fit_each_kind_of_data(kind, request, tmp_path):
    """Each command with its defaults on each kind of data. What is checked is that the defaults are
    taken, not how well they train: ``--max-steps 1`` stops train and simulate after their first step, and
    remedies runs one candidate against a given reference accuracy (no np=1 reference run, no price)."""
    data = str(request.getfixturevalue(kind))
    n_train = {"folder": 400, "arrays": 240, "digits": 1500}[kind]
    for args in (["train", "--max-steps", "1"], ["simulate", "--np", "4", "--max-steps", "1"]):
        p = _pilab(*args, "--data", data, cwd=tmp_path)
        assert p.returncode == 0, (args, p.stderr[-3000:])
        result = json.loads((tmp_path / "runs" / args[0] / "result.json").read_text())
        assert result["data"]["n_train"] == n_train and result["steps_done"] == 1, args
    p = _pilab("remedies", "--data", data, "--only", "baseline", "--reference-acc", "0.5", "--target", "none",
               cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "runs" / "remedies" / "remedies.json").read_text())
    np_ = min(48, n_train // 32)  # 12, 7, 46: each rank a batch of 32
    assert res["np"] == np_ and (np_ < 48) == (f"--np {np_} instead of the default 48" in p.stderr), p.stderr
