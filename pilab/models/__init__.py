"""The models: names and widths (``names``, no torch), the builders (``zoo``), predicted memory
(``memory``). Importing this package imports none of them.
"""
