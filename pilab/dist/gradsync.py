"""Fused, overlapped gradient averaging: ``GradSync`` posts each bucket's ``Iallreduce`` from the
gradient hooks while backward is still running (Horovod's fusion buffer, DDP's buckets), with named
``Slots`` of per-step values riding with the last bucket (``pilab.dist``'s face offers it)::

    sync = GradSync(model, MPI.COMM_WORLD, bucket_mb=1.0)
    sync.backward(loss)      # buckets are posted from gradient hooks as they fill
    stats = sync.finish()    # waits for the rest, writes averaged gradients into p.grad
"""
from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .buckets import bucket_assignment
from .codec import codec_for
from .comm import MPI, SPIN_BYTES_PER_S, SPIN_S, Slots, mpi_buffer, share_of_mean, wait_polling, world


@dataclass
class StepComm:
    """Communication figures of one step, in seconds and bytes (this rank)."""
    total: float = 0.0  # first bucket posted -> last bucket complete
    exposed: float = 0.0  # time spent waiting after backward ended (not hidden behind compute)
    bytes_sent: int = 0  # payload handed to Allreduce (as its codec sends it: halved by fp16)
    buckets: int = 0
    messages: int = 0  # Iallreduce calls for them (buckets ready together go as one)
    first_post: float = 0.0  # perf_counter() when the first bucket was posted
    backward_end: float = 0.0  # perf_counter() when finish() was called
    posts: list = field(default_factory=list)  # perf_counter() of each post, in bucket order
    ready: float = 0.0  # perf_counter() when this rank's last bucket went out (its gradients were all in)
    tests: int = 0  # Testall calls made from the gradient hooks this step
    # observe=True only: per message [first bucket index, bytes, posted,
    # first seen complete] (perf_counter() seconds), in posting order
    flights: list = field(default_factory=list)
    stepped: float = 0.0  # finish(step=...): seconds spent stepping landed buckets inside the wait (not in exposed)


class _Bucket:
    def __init__(self, params: list[nn.Parameter], flat: torch.Tensor, wire: torch.Tensor | None, offset: int,
                 index: int = 0):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.offset = offset  # where it starts in GradSync's one buffer (consecutive buckets are adjacent)
        self.index = index  # its place in posting order
        self.flat = flat[offset:offset + self.numel]
        self.wire = wire[offset:offset + self.numel] if wire is not None else self.flat
        self.pending = 0
        self.views: list = []  # per parameter: its slot of `flat` with the parameter's strides, or None
        self.all_views = False  # every parameter has a slot: no per-parameter copy into or out of `flat`


_GRAD = operator.attrgetter("grad")


def _dense(p: torch.Tensor) -> bool:
    """True if ``p`` covers its numel elements without gaps (so a slot of a flat buffer can hold it)."""
    return p.is_contiguous() or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last))


class GradSync:
    """Average gradients over ``comm`` in fused buckets, posting each bucket's ``Iallreduce`` from
    the gradient hooks as soon as it is full, so communication overlaps the rest of backward
    (Horovod's fusion buffer, DDP's buckets).

    Gradients are *views into the buckets* (DDP's ``gradient_as_bucket_view``): backward
    accumulates straight into the fusion buffer and the averaged result lands in ``p.grad`` in place —
    no copy in, no copy out. A gradient that someone replaced (``zero_grad(set_to_none=True)``) is copied
    in once and re-pointed at its slot; a parameter whose layout a flat slot cannot hold is copied.

    MPICH progresses a non-blocking collective only inside MPI calls, so the hooks call ``Testall`` on
    the outstanding requests at every gradient and every post (``MPIR_CVAR_ASYNC_PROGRESS=1`` is the
    alternative, measured by ``python -m pilab bench --sections sync``). Every gradient: between two
    nodes at 1 Gbit/s each phase of a 1 MiB Allreduce waits for
    the next poll, and polling every 8th gradient left 9-13% more on the step than every one (MobileNetV2
    1.0, 2 nodes, 15 alternated rounds; the same at 200 Mbit/s, where the link bounds it),
    while a Testall costs about a microsecond.

    ``finish()`` polls with Testall for ``SPIN_S`` and then naps between polls, instead of MPI's busy
    ``Waitall``: on a machine with more runnable processes than cores a
    rank spinning while it waits for a straggler takes CPU from that rank, and the time shows up as the
    straggler's *compute*.

    ``meta`` (a count, or named ``Slots``) float64 slots ride with the last bucket (their own tiny
    Iallreduce, posted the moment the last bucket is, completed by the same wait): the caller writes
    per-step values into its slots before backward; after ``finish()`` they hold the sums over ranks, and
    GradSync's own slots ``sync.meta[sync.slots["ready"]]`` every rank's ready time (its last post, seconds
    after ``begin(t0)``).
    So the step needs no second collective — and no second point where ranks wait for each other.

    Each rank's gradient is divided by the world size before it is sent (so the sum is the mean, and with
    ``compression="fp16"`` the sum of np halves cannot overflow): for free when the caller runs backward
    through ``sync.backward(loss)``, which scales the loss by 1/size; by a pass over each bucket
    otherwise. ``compression`` names the ``Codec`` a bucket travels through (``pilab.dist.codec``): with
    ``"fp16"`` it is sent as half precision, half the bytes::

        sync = GradSync(model, comm, bucket_mb=1.0, meta=2)
        for x, y in batches:
            opt.zero_grad(set_to_none=False)
            sync.begin(time.perf_counter())
            loss = loss_fn(model(x), y)
            sync.meta[:2] = [loss.item(), len(y)]
            sync.backward(loss)        # or loss.backward(): the same mean, one pass more
            stats = sync.finish()      # StepComm: total and exposed seconds; sync.meta: the sums
            opt.step()
    """

    def __init__(self, model: nn.Module, comm, *, bucket_mb: float = 1.0, tail_mb: float = 0.0,
                 compression: str = "none", meta: "int | Slots" = 0, on_send=None, observe: bool = False):
        self.comm = comm
        self.observe = observe  # note when each message completes (StepComm.flights)
        # on_send(grads): given each bucket's gradients as this rank sends them (its share of the average,
        # after the division), before the Allreduce sums them in place: what a rank's own gradient is
        self.on_send = on_send
        self.rank, self.size = world(comm)
        # how a bucket travels (pilab.dist.codec); coded: in a wire buffer of its own type
        self.codec = codec_for(compression)
        self.coded = self.codec.coded
        self.wire_type = self.codec.mpi_type() if self.coded and self.size > 1 else None
        params = [p for p in model.parameters() if p.requires_grad]
        # Gradients arrive roughly in reverse definition order; fill buckets in that order so the
        # first one is complete early in backward.
        order = list(reversed(params))
        groups = [[order[i] for i in idx] for idx in bucket_assignment([p.numel() for p in order], bucket_mb, tail_mb)]
        # One buffer, the buckets adjacent slices of it in posting order: buckets that are ready together
        # (what is left when backward ends; all of them when the hooks are off) go as one Allreduce, which
        # MPI moves faster than several (one 8.9 MB message vs twelve of 0.75 MB: 0.78x the bandwidth here).
        total = sum(p.numel() for p in params)
        # numpy's allocation, not torch's: MPICH's shared-memory Allreduce moved a buffer at torch's 64-byte
        # alignment ~10% slower than the same bytes at numpy's (2.7 vs 3.0 ms for 8.9 MB, np=2, here)
        self._flat = torch.from_numpy(np.zeros(total, dtype=np.float32))
        self._wire = torch.zeros(total, dtype=getattr(torch, self.codec.dtype)) if self.coded else self._flat
        self._wire_np = mpi_buffer(self._wire)  # sliced per message: a numpy slice is cheaper than a tensor's
        offsets = list(itertools.accumulate([0] + [sum(p.numel() for p in g) for g in groups]))
        self.buckets: list[_Bucket] = [_Bucket(g, self._flat, self._wire if self.coded else None, off, i)
                                       for i, (g, off) in enumerate(zip(groups, offsets))]
        self._where: dict[int, int] = {}
        for i, b in enumerate(self.buckets):
            for p in b.params:
                self._where[id(p)] = i
        self.slots = meta if isinstance(meta, Slots) else Slots()
        if not isinstance(meta, Slots):
            self.slots.declare("user", meta)
        self.n_meta = self.slots.size  # the caller's slots; GradSync's own follow
        self.slots.declare("ready", self.size)  # rank r's: its last post, seconds after begin(t0)
        self.meta = np.zeros(self.slots.size, dtype=np.float64)
        self._meta_request = None
        self._param_flats = None  # average_parameters_'s buffers
        self._t0 = 0.0
        self._hooks = []
        # False for a local-SGD step (pilab.engine.localsgd): the gradients stay this rank's, only meta travels
        self.exchange = True
        if self.size > 1:
            for b in self.buckets:
                b.views = self._make_views(b)
                b.all_views = all(v is not None for v in b.views)
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._reset()

    @staticmethod
    def _make_views(b: _Bucket) -> list:
        out, offset = [], 0
        with torch.no_grad():
            for p in b.params:
                n = p.numel()
                view = None
                if _dense(p) and p.device.type == "cpu" and p.dtype == torch.float32:
                    view = b.flat.as_strided(p.shape, p.stride(), b.flat.storage_offset() + offset)
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view
                out.append(view)
                offset += n
        return out

    # -- per step --------------------------------------------------------------------------
    def _reset(self):
        for b in self.buckets:
            b.pending = len(b.params)
        self._next = 0  # buckets are posted strictly in index order: same collective order on all ranks
        self._ready = [False] * len(self.buckets)
        self._inflight: list = []
        self._requests: list = []  # one per message (a run of buckets shares it)
        self._runs: list = []  # each message's buckets
        self._landed: list = []  # finish(step=...): each message seen complete
        self._stepped: list = []  # ... and its parameters stepped
        self._meta_request = None
        self.seeded = False  # this step's gradients came out of backward already divided (see backward())
        self.stats = StepComm()

    def begin(self, t0: float) -> None:
        """The step's start (``time.perf_counter()``): ready times in ``meta`` are counted from it."""
        self._t0 = t0

    def backward(self, loss: torch.Tensor, weight: float | None = None) -> None:
        """``loss.backward()`` with the average's 1/size folded into the loss (``share_of_mean``): the
        gradients come out already divided, so a bucket is sent as it is (no pass over its bytes to divide it, which cost
        GradSync a seventh of its shared-memory bandwidth). A local-SGD step keeps its own gradient::

            sync.backward(loss)     # instead of loss.backward()
            sync.finish()

        The simulator scales its ranks' losses alike (``pilab.engine.mpi.VirtualRanks``), so the
        two still form the same sums bit for bit. ``weight``: this rank's share of the average instead of
        1/size (uneven shares: b_r / B, so the sum over the ranks is the mean over the global batch)."""
        if self.size > 1 and self.exchange:
            self.seeded = True
            (share_of_mean(loss, self.size) if weight is None else loss * weight).backward()
        else:
            loss.backward()

    def _on_grad(self, p):
        if not self.exchange:
            return
        i = self._where[id(p)]
        b = self.buckets[i]
        b.pending -= 1
        if b.pending == 0:
            self._ready[i] = True
            self._post_ready()
        else:
            self._test()

    def _post_ready(self):
        first = self._next
        while self._next < len(self.buckets) and self._ready[self._next]:
            self._prepare(self.buckets[self._next])
            self._next += 1
        if self._next > first:  # the ready run of buckets, adjacent in the buffer: one message
            self._send(self.buckets[first:self._next])
            if self._next == len(self.buckets):
                self._post_meta()
        self._test()

    def _prepare(self, b: _Bucket):
        """The bucket's bytes made ready to send: every gradient in its slot, divided, encoded."""
        # The usual case first, in one pass at C speed: backward accumulated every gradient into its slot
        # (the per-parameter loop below took 0.09 ms of a 2 ms exchange of 8.9 MB on shared memory)
        if not (b.all_views and all(map(operator.is_, map(_GRAD, b.params), b.views))):
            self._gather(b)
        if not self.seeded:  # pre-divide: the sum is then the mean, and a narrow codec's cannot overflow
            b.flat.div_(self.size)
        if self.on_send is not None:
            self.on_send(self._tensors(b))
        if self.coded:
            self.codec.encode(b.flat, b.wire)

    @staticmethod
    def _tensors(b: _Bucket) -> list:
        """``b``'s gradients as they sit in its slot of the buffer, one tensor per parameter."""
        out, offset = [], 0
        for p, view in zip(b.params, b.views):
            n = p.numel()
            out.append(view if view is not None else b.flat[offset:offset + n])
            offset += n
        return out

    @staticmethod
    def _gather(b: _Bucket):
        """Every gradient of ``b`` into its slot: those backward put elsewhere (a replaced or dropped
        ``p.grad``) copied, and the slot made ``p.grad`` again; parameters without a slot copied."""
        offset = 0
        for p, view in zip(b.params, b.views):
            n = p.numel()
            if view is not None:
                g = p.grad
                if g is view:  # backward accumulated into the slot (torch keeps one Python object per tensor)
                    offset += n
                    continue
                if g is None or g.data_ptr() != view.data_ptr():  # replaced or dropped: back into its slot
                    if g is None:
                        view.zero_()
                    else:
                        view.copy_(g)
                    p.grad = view
            elif p.grad is None:
                b.flat[offset:offset + n].zero_()
            else:
                b.flat[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n

    def _send(self, run: list):
        lo, hi = run[0].offset, run[-1].offset + run[-1].numel
        wire = self._wire_np[lo:hi]
        msg = [wire, self.wire_type] if self.coded else wire
        now = time.perf_counter()
        if not self.stats.posts:
            self.stats.first_post = now
        self.stats.posts.extend([now] * len(run))  # one time per bucket, whatever the messages
        self.stats.bytes_sent += wire.nbytes
        request = self.comm.Iallreduce(MPI.IN_PLACE, msg, op=MPI.SUM)
        self.stats.messages += 1
        self._requests.append(request)
        self._runs.append(run)
        self._landed.append(False)
        self._stepped.append(False)
        self._inflight.append(request)
        if self.observe:
            self.stats.flights.append([run[0].index, wire.nbytes, now, None])

    def _post_meta(self):
        now = time.perf_counter()
        self.stats.ready = now
        self.meta[self.n_meta:] = 0.0
        self.meta[self.slots["ready"]][self.rank] = now - self._t0
        self._meta_request = self.comm.Iallreduce(MPI.IN_PLACE, self.meta, op=MPI.SUM)
        self._inflight.append(self._meta_request)

    def _test(self):
        if self._inflight:
            self.stats.tests += 1
            if self.observe:
                self._observe()
            elif MPI.Request.Testall(self._inflight):
                self._inflight = []

    def _observe(self) -> bool:
        """``observe=True``'s test: each message not yet seen complete tested on its own, in posting order
        (instead of one Testall), the time it is first seen complete noted in ``StepComm.flights``; True
        once every message and the metrics are done."""
        flights, now = self.stats.flights, None
        for f, request in zip(flights, self._requests):
            if f[3] is None and request.Test():  # a completed request becomes REQUEST_NULL: Testall skips it
                now = now or time.perf_counter()
                f[3] = now
        done = all(f[3] is not None for f in flights)
        if done and self._meta_request is not None and self._meta_request.Test():
            self._inflight = []
            return True
        return False

    def _wait(self, late_bytes: int = 0):
        reqs = self._requests + [self._meta_request]
        wait_polling(reqs, max(SPIN_S, late_bytes / SPIN_BYTES_PER_S), test=self._observe if self.observe else None)

    def _poll_landing(self, step) -> bool:
        """``finish(step=...)``'s test: every message not yet seen complete tested (``observe``: the time
        noted), then the parameters of one landed message stepped; True once all are stepped and the
        metrics are done. One message per poll: stepping makes no MPI call, so the messages still in flight
        move again between two buckets' steps (a bucket is <= bucket_mb: a fraction of a millisecond)."""
        flights, now = self.stats.flights, None
        for k, request in enumerate(self._requests):
            if not self._landed[k] and request.Test():
                self._landed[k] = True
                if self.observe and flights[k][3] is None:  # not already seen complete from a gradient hook
                    now = now or time.perf_counter()
                    flights[k][3] = now
        for k, run in enumerate(self._runs):
            if self._landed[k] and not self._stepped[k]:
                t = time.perf_counter()
                self._unpack(run)
                step([p for b in run for p in b.params])
                self._stepped[k] = True
                self.stats.stepped += time.perf_counter() - t
                return False
        return all(self._landed) and self._meta_request.Test()

    def _unpack(self, buckets, wire: bool = True) -> None:
        """The averages of ``buckets`` into ``p.grad``: decoded from the wire, and into the gradients that
        are not views of the buffer (a layout a flat slot cannot hold)."""
        for b in buckets:
            if self.coded and wire:
                self.codec.decode(b.wire, b.flat)
            if b.all_views:  # every gradient is already its slot of the averaged buffer
                continue
            offset = 0
            for p, view in zip(b.params, b.views):
                n = p.numel()
                if view is None:
                    if p.grad is None:
                        p.grad = torch.empty_like(p)
                    p.grad.copy_(b.flat[offset:offset + n].view_as(p.grad))
                offset += n

    def finish(self, step=None) -> StepComm:
        """Call after ``backward()``: posts what is left, waits, leaves averaged grads in ``p.grad``
        (and the summed ``meta``).

        ``step``: a callable given a list of parameters whose averaged gradients have landed
        (``optim.SubsetStep``), called once per message while the later messages are still in flight, so the
        optimizer's work fills the wait instead of following it (every bucket's parameters exactly once;
        the caller steps whatever else it has afterwards)."""
        stats = self.stats
        if self.size == 1:
            stats.ready = time.perf_counter()
            self.meta[self.slots["ready"]][0] = stats.ready - self._t0
            self._reset()
            return stats
        t_end = time.perf_counter()
        stats.backward_end = t_end
        if not self.exchange:  # a local step: the metrics and votes alone are summed
            return self._finish_meta(t_end)
        # Parameters that got no gradient this step (unused branches) still take part, as zeros.
        for i in range(len(self.buckets)):
            self._ready[i] = True
        sent = stats.bytes_sent
        self._post_ready()
        if self._meta_request is None:  # no buckets at all (nothing trainable): the metrics still travel
            self._post_meta()
        late = stats.bytes_sent - sent
        if step is not None:
            wait_polling(None, max(SPIN_S, late / SPIN_BYTES_PER_S), test=lambda: self._poll_landing(step))
        else:
            self._wait(late)
            if self.coded:
                self.codec.decode(self._wire, self._flat)  # in one piece
            self._unpack(self.buckets, wire=False)
        done = time.perf_counter()
        stats.exposed = done - t_end - stats.stepped
        stats.total = done - stats.first_post
        stats.buckets = len(self.buckets)
        self._reset()
        return stats

    def _finish_meta(self, t_end: float) -> StepComm:
        stats = self.stats
        stats.first_post = t_end
        self._post_meta()
        MPI.Request.Waitall([self._meta_request])
        done = time.perf_counter()
        stats.exposed = stats.total = done - t_end
        self._reset()
        return stats

    @torch.no_grad()
    def average_parameters_(self) -> int:
        """Every rank's parameters become their mean (blocking; local SGD's average): in the gradient
        buckets' layout and order, each bucket divided by the world size and summed by Allreduce, so the
        sums are formed as the gradients' are, which the simulator reproduces
        (``pilab.engine.virtual.VirtualReplicas.average_``). Returns the bytes this rank sent::

            sent = sync.average_parameters_()
        """
        if self.size == 1:
            return 0
        if self._param_flats is None:  # one buffer per bucket, made on first use
            self._param_flats = [torch.empty_like(b.flat) for b in self.buckets]
        reqs, sent = [], 0
        for b, flat in zip(self.buckets, self._param_flats):
            offset = 0
            for p in b.params:
                n = p.numel()
                flat[offset:offset + n].copy_(p.reshape(-1))
                offset += n
            flat.div_(self.size)
            reqs.append(self.comm.Iallreduce(MPI.IN_PLACE, mpi_buffer(flat), op=MPI.SUM))
            sent += flat.numel() * flat.element_size()
        MPI.Request.Waitall(reqs)
        for b, flat in zip(self.buckets, self._param_flats):
            offset = 0
            for p in b.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        return sent

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
