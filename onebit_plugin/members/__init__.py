"""The members of the family, each a thin class over the base with its policy: 1-bit Adam, 0/1 Adam
(with its local steps) and 1-bit LAMB.
"""
