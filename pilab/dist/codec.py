"""How gradients travel: a ``Codec`` is what ``Config.compression`` names -- the type a bucket has on
the wire, how it is written there from the float32 gradients and read back, and what that costs
(bytes per element, memory, whether MPI sums it in software, whether the simulator forms the same
sums). ``GradSync`` sends every bucket through one, the memory check and the performance model price
it, and the simulator refuses one it does not emulate, so a new way to send gradients is a class
here and its name among ``compression``'s choices in ``pilab/config.py``::

    from pilab.dist import codec_for
    c = codec_for("fp16")
    c.itemsize, c.extra_bytes(1_000_000)     # (2, 2000000): half the bytes sent, one half copy kept

Importing it loads neither torch nor MPI: the performance model prices a codec on a machine that
has neither.
"""
from __future__ import annotations

from .. import launch
from ..config import ConfigError


class Codec:
    """The identity: a bucket is sent as its float32 gradients, in place."""
    name = "none"
    dtype = "float32"  # torch's name for the wire's element type
    itemsize = 4  # bytes per element on the wire
    software_sum = False  # MPICH sums this type without vector code: the model adds Cluster.gamma_fp16 a byte
    simulated = True  # the simulator forms the same sums bit for bit

    @property
    def coded(self) -> bool:
        """True if the wire is a buffer of its own (another type than the gradients')."""
        return self.dtype != "float32"

    def extra_bytes(self, params: int) -> int:
        """Memory a rank keeps beyond the gradients for ``params`` elements: its wire copy, if any."""
        return params * self.itemsize if self.coded else 0

    def mpi_type(self):
        """The MPI datatype to send the wire as; None: the buffer's own (numpy's float32)."""
        return None

    def encode(self, flat, wire) -> None:
        """``wire`` from the averaged-to-be float32 gradients ``flat`` (the same slice of both)."""

    def decode(self, wire, flat) -> None:
        """The summed ``wire`` back into the float32 gradients ``flat``."""


class Half(Codec):
    """IEEE half precision: half the bytes. Each rank's gradient is divided by the world size before it
    is cast (``GradSync`` pre-divides), so the sum of np halves cannot overflow."""
    name = "fp16"
    dtype = "float16"
    itemsize = 2
    software_sum = True
    simulated = False  # MPI's half-precision sum rounds at every addition, in its own order

    def mpi_type(self):
        t = fp16_type()
        if t is None:
            raise RuntimeError("compression=fp16 needs an MPI library with a half-precision type "
                               "(MPICH >= 4.1); use compression=none")
        return t

    def encode(self, flat, wire) -> None:
        wire.copy_(flat)

    def decode(self, wire, flat) -> None:
        flat.copy_(wire)


def fp16_type():
    """MPI's datatype for IEEE half precision, or None if this MPI library has none."""
    MPI = launch.mpi()
    t = getattr(MPI, "FLOAT16_T", None)
    return None if t is None or t == MPI.DATATYPE_NULL else t


CODECS = {c.name: c for c in (Codec(), Half())}


def codec_for(name: str) -> Codec:
    """The codec ``Config.compression`` names (one line naming the choices for another)."""
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"compression={name!r} is not a codec pilab has; use one of: "
                          f"{', '.join(CODECS)}") from None
