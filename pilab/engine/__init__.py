"""The engine: the one training loop (``loop``), its entry points (``train``, ``simulate``, ``harness``) and
the building blocks it runs on. Importing this package imports none of them.
"""
