"""Compile every kernel of ``tests/kernels/triton/test_compile_targets.py`` for sm_90 with whichever Triton
imports first: a check of the pinned floor (Triton 3.0) by hand, no GPU needed.

    pip install --no-deps --target /tmp/triton30 triton==3.0.0
    PYTHONPATH=/tmp/triton30 python -m tests.helpers.kernels.compile_floor

Triton 3.0's ``ASTSource`` takes argument indices, not names; the native ``moe_align`` specs are
expected to fail there (``tl.gather``, masked ``tl.histogram``), their portable spec to compile.
(Triton 3.0's interpreter does not run under numpy 2, so the maths is checked on the installed Triton.)
"""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tests.kernels import test_compile_targets as t

print("triton", triton.__version__)
specs = t._specs()
ok, bad = [], []
for name, (fn, types, consts) in specs.items():
    names = fn.arg_names
    consts = {k: (v.value if hasattr(v, "value") else v) for k, v in consts.items()}
    sig = {i: types.get(a, "i32") for i, a in enumerate(names) if a not in consts}
    cst = {names.index(k): v for k, v in consts.items() if k in names}
    try:
        triton.compile(ASTSource(fn, sig, cst), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ok.append(name)
    except Exception as e:
        bad.append((name, type(e).__name__, str(e).strip().splitlines()[-1][:200]))
print("compiled with this triton:", len(ok))
for b in bad:
    print("FAILED", *b)
