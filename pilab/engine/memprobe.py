"""What a model's training step costs in memory beyond its saved activations, measured on the model itself.

    from pilab.engine.memprobe import step_memory
    warm, per_image = step_memory("mynets:resnet8", width=1.0, timesteps=None, shape=(3, 32, 32),
                                  threads=1, malloc=(("MALLOC_MMAP_THRESHOLD_", "1073741824"),))
    # bytes, bytes per image

``pilab.engine.memory`` predicts the activations of a training step from the elements its layers write
and a factor measured on the registered networks (MobileNetV2's: autograd's saved tensors, the backward's
gradients in flight, glibc keeping freed blocks, oneDNN's scratch). That factor is the model's, not a
constant: beyond its saved activations a plain 3x3-convolution ResNet at full 32x32 resolution keeps about
as much again (small_resnet at 256 images: 173 MB saved, 150-190 MB more), MobileNetV2 about half as much. For a
model pilab has not calibrated, this module measures it: a child process (so the caller's RSS is not
touched) builds the model, with malloc set as a rank's (``malloc``: glibc's variables, which
``memory.tune_allocator`` sets with mallopt in a rank) and, in a fresh fork
per batch size, runs ``STEPS`` SGD steps on random images; the growth of its peak RSS (VmHWM) over the
RSS before the first step, less the model state and the input, is ``warm + per_image * batch``, fitted on
the two batch sizes ``BATCHES``.

Cost: one python with torch imported, then ``REPEATS`` forks of ``STEPS`` steps at each of 16 and 64 images:
about 2 s of CPU for small_resnet (width 1.0, 32x32), 4-7 s wall on a shared 2-core machine; once per
setting and process (cached), and ``memory.choose_allocator`` / ``fit_warning`` only ask for it near the
node's limit.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

__all__ = ["step_memory", "BATCHES", "STEPS", "ProbeError"]

BATCHES = (16, 64)  # images per step: small enough to be cheap, far enough apart for a slope
REPEATS = 3  # forks per batch size, their median taken: where glibc's heap lands varies by some 15% at 128 images
STEPS = 2  # the first step pages in the kernels and fills oneDNN's cache; the second reuses freed blocks


class ProbeError(RuntimeError):
    """The probe could not measure the model (it does not import in a child process, or its step failed)."""


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


@functools.lru_cache(maxsize=None)
def step_memory(model: str, width: float, timesteps: int | None, shape: tuple[int, int, int], threads: int,
                malloc: tuple = (), num_classes: int = 10) -> tuple[int, int]:
    """(bytes a training step adds once, bytes per image of the batch) for ``model`` on images of ``shape``
    (C, H, W), measured in a child process (see the module's docstring); raises ProbeError."""
    if not sys.platform.startswith("linux"):
        raise ProbeError("the probe reads /proc/self/status (Linux only)")
    from ..models.custom import _LOCAL
    if model in _LOCAL or model.startswith("__main__:"):  # a function defined in __main__ or a notebook cell: no child process can import it
        raise ProbeError(f"{model} is defined in this process only; put it in a .py file to have it measured")
    args = [model, repr(width), repr(timesteps), ",".join(map(str, shape)), str(threads), str(num_classes)]
    env = dict(os.environ, **dict(malloc))
    # the builder is imported by its string there: give the child every directory this process imports from
    env["PYTHONPATH"] = os.pathsep.join([p or os.getcwd() for p in sys.path])
    try:
        p = subprocess.run([sys.executable, "-m", "pilab.engine.memprobe", *args], capture_output=True,
                           text=True, timeout=600, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProbeError(f"the memory probe of {model} did not run: {e}") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise ProbeError(f"the memory probe of {model} failed: {last}")
    grown = json.loads(p.stdout.strip().splitlines()[-1])
    (b1, e1), (b2, e2) = sorted((int(b), e) for b, e in grown.items())
    per_image = max(0.0, (e2 - e1) / (b2 - b1))
    return int(max(0.0, e1 - per_image * b1)), int(per_image)


def _one_batch(model: str, width: float, timesteps, shape, num_classes: int, batch: int) -> int:
    """In a forked child: the RSS ``STEPS`` training steps of ``batch`` images add, less model state and input."""
    import torch
    import torch.nn.functional as F

    from .optim import SGD
    from ..models.zoo import build_model

    torch.manual_seed(0)
    net = build_model(model, num_classes=num_classes, width=width, timesteps=timesteps)
    net = net.train().to(memory_format=torch.channels_last)  # as engine.backend builds a rank's model
    opt = SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, *shape).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, num_classes, (batch,))
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS (Linux >= 4.0)
        f.write("5")
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    state = sum(p.numel() * p.element_size() * 3 for p in net.parameters())  # weights' grads and momentum
    return _status("VmHWM") - before - state


def main(argv: list[str]) -> int:
    model, width, timesteps, shape, threads, num_classes = argv
    import torch  # imported here, in the parent, before any fork: each child starts with it

    from .optim import SGD  # noqa: F401
    from ..models.zoo import build_model  # noqa: F401

    torch.set_num_threads(int(threads))
    ts = None if timesteps == "None" else int(timesteps)
    shape = tuple(int(s) for s in shape.split(","))
    out = {}
    for batch in BATCHES:
        got = sorted(_in_a_fork(model, float(width), ts, shape, int(num_classes), batch) for _ in range(REPEATS))
        if None in got:
            return 1
        out[batch] = got[len(got) // 2]
    print(json.dumps(out))
    return 0


def _in_a_fork(model: str, width: float, ts, shape, num_classes: int, batch: int) -> int | None:
    """``_one_batch`` in a fresh process (it reuses none of another batch's free blocks); None if it failed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        code = 1
        try:
            os.write(w, str(_one_batch(model, width, ts, shape, num_classes, batch)).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001  (the parent says what failed)
            print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    return int(got) if status == 0 and got else None


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
