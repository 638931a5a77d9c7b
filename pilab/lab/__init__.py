"""The lab's notebook front-ends: ``widgets`` (the ipywidgets panel) and ``cluster`` (ipyparallel
engines). Importing this package imports none of them.
"""
