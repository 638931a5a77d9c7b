"""Your own model and your own data (issue 37): models pilab does not define (tests/own_models.py) and data
pilab did not make (sklearn's digits; a 5-class 64x64 ImageFolder cut from the CIFAR-10 archive).

* the simulator against real MPI ranks on two such models (tests/custom_worker.py), bitwise;
* every BatchNorm variant and dropout made per virtual rank, a batch-mixing layer refused;
* the data: any size, channels and classes, statistics from the training set, the cache keyed by content,
  every image once per epoch over the ranks;
* bad input: one line, exit 2, nothing written, before any rank starts.
"""
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import MPIEXEC, mpi_env
from pilab import data
from pilab.config import Config
from pilab.data import DataError
from pilab import engine
from pilab.engine import layers, ownmodel as preflight
from pilab.models import custom
from pilab.models.names import ModelError

HERE = Path(__file__).parent
MODELS = HERE / "own_models.py"


# ---------------------------------------------------------------------------------------------------
# the simulator against real ranks
# ---------------------------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_the_simulator_reproduces_mpi_on_models_pilab_does_not_define(np_, tmp_path):
    out = tmp_path / "res.json"
    p = subprocess.run([MPIEXEC, "-n", str(np_), sys.executable, str(HERE / "custom_worker.py"), str(out)],
                       capture_output=True, text=True, timeout=420, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("resnet", "head"):
        r = res[name]
        assert r["steps"] == 14
        # every rank's parameters and BatchNorm buffers, bitwise (one rank per forward: MPI's arithmetic)
        assert r["diff_per_rank"] == [0.0] * np_, (name, r["diff_per_rank"])
        assert r["loss"] == r["sim_loss"]
        # SyncBatchNorm (of BatchNorm1d too; in groups of 2 ranks at np=4+): one forward over all ranks in
        # the simulator, the same mathematics to float rounding (the statistics are summed in float64 per rank)
        assert r["sim_sync_loss"] == pytest.approx(r["sync_loss"], rel=2e-5), name


# ---------------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bn", [nn.BatchNorm1d(6), nn.BatchNorm1d(6, affine=False), nn.BatchNorm3d(6),
                                nn.BatchNorm2d(6, momentum=None), nn.BatchNorm2d(6, track_running_stats=False)],
                         ids=["1d", "1d-no-affine", "3d", "2d-cumulative", "2d-no-running-stats"])
def test_every_batchnorm_becomes_per_rank_exactly(bn):
    """Three virtual ranks in one forward: each rank's rows normalised and its running statistics kept as
    its own BatchNorm would, bitwise, over two steps; the state_dict keys stay the BatchNorm's."""
    shape = {nn.BatchNorm1d: (4, 6, 5), nn.BatchNorm2d: (4, 6, 3, 3), nn.BatchNorm3d: (4, 6, 2, 2, 2)}[type(bn)]
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
    ctx = layers.RankContext()
    ghost = layers.use_ghost_batchnorm(nn.Sequential(bn), ranks=3, context=ctx)
    assert set(ghost.state_dict()) == {"0." + k for k in bn.state_dict()}
    refs = [nn.Sequential(type(bn)(6, momentum=bn.momentum, affine=bn.affine,
                                   track_running_stats=bn.track_running_stats)) for _ in range(3)]
    for ref in refs:
        ref.load_state_dict(nn.Sequential(bn).state_dict())
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        xs = [torch.randn(*shape, generator=g) * (r + 1) + r for r in range(3)]
        ctx.ranks = (0, 3)
        out = ghost(torch.cat(xs))
        want = torch.cat([ref(x) for ref, x in zip(refs, xs)])
        assert torch.equal(out, want)
    if bn.track_running_stats:
        for r in range(3):
            state = layers.virtual_state(ghost, r)
            for k, v in refs[r].state_dict().items():
                assert torch.equal(state[k], v), (r, k)


def test_a_layer_that_mixes_the_batch_is_refused_before_training():
    with pytest.raises(ModelError, match=r"layer 4 \(_HandMadeNorm\) mixes the images of a batch.*nn.GroupNorm"):
        preflight.check_model(Config(model=f"{MODELS}:hand_norm"))
    preflight.check_model(Config(model=f"{MODELS}:group_norm"))  # GroupNorm, LayerNorm: per image, accepted
    preflight.check_model(Config(model=f"{MODELS}:bn1d_head"))


def test_a_builder_from_python_and_its_width():
    def mine(num_classes):
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))

    spec = custom.model_spec(mine)
    assert custom.is_local(spec) and Config(model=spec).model == spec
    assert custom.build(spec, 7)(torch.zeros(2, 3, 8, 8)).shape == (2, 7)
    assert custom.build(spec, 7, 0.5)(torch.zeros(2, 3, 8, 8)).shape == (2, 7)  # no width parameter: ignored
    # width reaches a builder that names it; registered names keep working
    assert sum(p.numel() for p in custom.build(f"{MODELS}:small_resnet", 10, 0.25).parameters()) < \
        sum(p.numel() for p in custom.build(f"{MODELS}:small_resnet", 10, 0.5).parameters())
    with pytest.raises(ModelError, match="MPI ranks cannot import; put it in a .py file"):
        preflight.check_model(Config(model=spec), mpi=True)
    r = engine.simulate(Config(train_subset=64, test_subset=32, batch_size=8, epochs=1, max_steps=2), 2, model_fn=mine)
    assert r["config"]["model"] == spec and r["steps_done"] == 2


# ---------------------------------------------------------------------------------------------------
# data pilab did not make
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits():
    sk = pytest.importorskip("sklearn.datasets")
    d = sk.load_digits()
    x = np.clip(d.images * 16, 0, 255).astype(np.uint8)  # 0..16 -> 0..255 grey levels
    return data.from_arrays(x[:1500], d.target[:1500], x[1500:], d.target[1500:])


def test_digits_one_channel_8x8_with_their_own_statistics(digits, tmp_path):
    assert digits.image_shape == (1, 8, 8) and digits.classes == tuple("0123456789")
    assert len(digits.mean) == 1 and 0.2 < digits.mean[0] < 0.4 and digits.std[0] > 0.3
    path = data.save(digits, str(tmp_path / "digits.npz"))
    again = data.load(path)
    assert again.checksum == digits.checksum and again.mean == digits.mean and again.classes == digits.classes
    assert data.describe(path)["image_shape"] == (1, 8, 8)
    # the memory model reads the shape from the file's headers (a grey 8x8 image is 64 bytes, not 3x...)
    from pilab.engine import memory
    assert memory.data_facts(Config(data=path)) == (1500, 297, (1, 8, 8))
    loader = data.ShardLoader(again, 3, 1, 16, seed=0)
    x, y = loader.batch(0, 0)
    assert x.shape == (16, 1, 8, 8) and abs(float(x.mean())) < 1.0 and loader.pad == 1
    # every training image once per epoch over the ranks (less the leftover), for any size and class count
    for policy in ("static", "reshuffle"):
        seen = np.concatenate([data.epoch_batches(again.y_train, 3, r, 16, 2, 0, policy).ravel() for r in range(3)])
        assert len(np.unique(seen)) == len(seen) == 3 * 16 * (1500 // 48)


def test_a_grey_model_trains_on_digits(digits, tmp_path):
    path = data.save(digits, str(tmp_path / "digits.npz"))
    cfg = Config(model=f"{MODELS}:small_resnet_grey", data=path, augment=False, batch_size=16, epochs=2,
                 lr=0.1, lr_ref_batch=16, threads=1)
    r = engine.simulate(cfg, 4)
    assert r["data"]["checksum"] == digits.checksum
    assert r["epochs"][-1]["test_acc"] > 0.5  # well above 0.1: it learns


def _folder_from_archive(archive: Path, root: Path, classes: int = 5, train: int = 40, test: int = 16,
                         size: int = 64) -> Path:
    """An ImageFolder of the first ``classes`` CIFAR-10 classes, upscaled to ``size`` px PNGs."""
    from PIL import Image
    import io

    want = {"train": train, "test": test}
    names = sorted(("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"))[:classes]
    count = {(s, c): 0 for s in want for c in names}
    with tarfile.open(archive, "r|gz") as tar:
        for m in tar:
            parts = m.name.split("/")
            if not m.isfile() or len(parts) < 3:
                continue
            split, cls = parts[-3], parts[-2]
            if (split, cls) not in count or count[(split, cls)] >= want[split]:
                continue
            img = Image.open(io.BytesIO(tar.extractfile(m).read())).convert("RGB").resize((size, size), Image.BICUBIC)
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            img.save(root / split / cls / f"{count[(split, cls)]:04d}.png")
            count[(split, cls)] += 1
            if all(count[k] >= want[k[0]] for k in count):
                break
    return root


def test_a_five_class_64px_image_folder(cifar_archive, tmp_path):
    root = _folder_from_archive(cifar_archive, tmp_path / "five")
    cache = str(tmp_path / "cache")
    ds = data.load(str(root), cache_dir=cache)
    assert ds.image_shape == (3, 64, 64) and ds.classes == ("airplane", "automobile", "bird", "cat", "deer")
    assert (len(ds.y_train), len(ds.y_test)) == (200, 80) and ds.mean != data.MEAN
    assert data.ShardLoader(ds, 2, 0, 8).pad == 8
    # a copy elsewhere is the same content: the same cache entry
    import shutil
    shutil.copytree(root, tmp_path / "copy")
    assert data.load(str(tmp_path / "copy"), cache_dir=cache).checksum == ds.checksum
    assert len([f for f in os.listdir(cache) if f.endswith(".npz")]) == 1
    # resized at decode: another entry, 32x32
    small = data.load(str(root), cache_dir=cache, image_size=32)
    assert small.image_shape == (3, 32, 32) and small.classes == ds.classes
    r = engine.simulate(Config(model=f"{MODELS}:small_resnet", width=0.25, data=str(root), batch_size=8, epochs=1,
                            max_steps=4, threads=1), 2)
    assert r["steps_done"] == 4 and r["data"]["n_train"] == 200


# ---------------------------------------------------------------------------------------------------
# bad input: one line naming the problem and the fix, exit 2, nothing written, before any rank starts
# ---------------------------------------------------------------------------------------------------
def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "pilab", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=dict(os.environ, PYTHONPATH=str(HERE.parent)))


def _bad_folders(tmp_path: Path) -> dict:
    from PIL import Image
    out = {}
    for name, specs in {"one": [("a", 8)], "mixed": [("a", 8), ("b", 12)]}.items():
        for split in ("train", "test"):
            for cls, px in specs:
                d = tmp_path / name / split / cls
                d.mkdir(parents=True)
                for i in range(4):
                    Image.new("RGB", (px, px), (i * 40, 0, 0)).save(d / f"{i}.png")
        out[name] = str(tmp_path / name)
    return out


def test_bad_input_is_refused_in_one_line_before_any_rank_starts(tmp_path):
    folders = _bad_folders(tmp_path)
    cases = {
        "no such module": (["--model", "nonexistent_module_xyz:build"], "cannot import nonexistent_module_xyz"),
        "not a module": (["--model", f"{MODELS}:not_a_module"], "returned a str, not a torch.nn.Module"),
        "wrong classes": (["--model", f"{MODELS}:wrong_classes"], r"output \(2, 11\).*10 classes"),
        "mixes the batch": (["--model", f"{MODELS}:hand_norm"], "mixes the images of a batch"),
        "one class": (["--data", folders["one"]], "1 class folder under train/; a classifier needs at least 2"),
        "mixed sizes": (["--data", folders["mixed"]], r"different sizes \(8x8, 12x12.*--image-size N"),
    }
    for case, (args, pattern) in cases.items():
        out = tmp_path / f"out-{case.replace(' ', '-')}"
        p = _cli("simulate", "--np", "2", "--epochs", "1", "--out", str(out), *args, cwd=tmp_path)
        assert p.returncode == 2, (case, p.stderr[-2000:])
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("pilab: error: "), (case, p.stderr)
        assert re.search(pattern, lines[0]), (case, lines[0])
        assert not out.exists(), case
    # train --np: refused by the launcher itself, before mpiexec
    p = _cli("train", "--np", "2", "--model", f"{MODELS}:wrong_classes", "--out", str(tmp_path / "t"), cwd=tmp_path)
    assert p.returncode == 2 and "launching" not in p.stderr and "10 classes" in p.stderr
    assert not (tmp_path / "t").exists()
    # with a resize the mixed folder loads
    assert data.load(folders["mixed"], image_size=10, cache_dir=str(tmp_path / "c")).image_shape == (3, 10, 10)


def test_bad_arrays_are_refused_in_one_line():
    x = np.zeros((20, 8, 8), np.uint8)
    y = np.arange(20) % 2
    for args, kw, pattern in [((x, np.zeros(20), x, y), {}, "y_train holds one class"),
                              ((x, y, x, y + 5), {}, None),
                              ((x, y, x, y + 5), {"classes": ["a", "b"]}, r"y_test holds labels 5\.\.6 outside 0\.\.1"),
                              ((x, y * -1, x, y), {}, "outside"),
                              ((np.zeros((20, 8, 8, 5)), y, x, y), {}, "5 channels; give 1 \\(grey\\) or 3"),
                              ((x, y, np.zeros((20, 9, 9), np.uint8), y), {}, "give both the same size")]:
        if pattern is None:  # labels 0..6 without names: seven classes "0".."6"
            assert data.from_arrays(*args, **kw).classes == tuple("0123456")
            continue
        with pytest.raises(DataError, match=pattern) as e:
            data.from_arrays(*args, **kw)
        assert "\n" not in str(e.value)
