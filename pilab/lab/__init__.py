"""The lab's notebook front-ends: ``widgets`` (the ipywidgets panel) and ``cluster`` (ipyparallel
engines). Importing this package imports none of them.
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
})
