"""The settings: every member's options checked once (``config``), the member registry
(``registry``), the words of the step kinds and 0/1 Adam's schedule, pure. The lowest layer: it
imports nothing else of the package.
"""
