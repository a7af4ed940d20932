"""The wire format: the 1-bit codec's layout and torch reference passes (``compression``), the
deferred folds and encoded averages the passes read (``deferred``), and the one door to
``kernels/`` (``dispatch``).
"""
