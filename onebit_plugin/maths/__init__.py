"""Pure update maths: Adam's and the frozen-variance update (``update``), LAMB's, the auto freeze's
rule, the norm sketch and the coordinate masks.
"""
