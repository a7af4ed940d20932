import os

# Triton kernels run on the CPU through the interpreter; it is chosen when a kernel is decorated,
# so this must be set before onebit_plugin.kernels is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
