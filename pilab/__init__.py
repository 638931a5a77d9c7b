"""pilab: synchronous data-parallel CNN training over MPI, and a lab for seeing when it turns fast-but-wrong.

    from pilab.config import Config
    from pilab.engine import train
    result = train.run(Config(epochs=1))      # one process; under mpiexec pass comm=MPI.COMM_WORLD
"""
__version__ = "0.1.0"
