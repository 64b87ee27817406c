"""kimitui's kernels: Triton kernels for CUDA / ROCm, the C++ CPU kernels and their bindings, and the PyTorch
references they are checked against (``kimitui.kernels.reference``). Imports only torch and triton."""

from kimitui._source_tree import with_folder

__path__ = with_folder(__path__, "kernels", "backend.py")  # the modules: the top-level kernels/ folder
