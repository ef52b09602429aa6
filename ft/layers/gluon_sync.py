"""A CTA-wide barrier for the Gluon kernels (Hopper), across the Triton versions we run.

The GPU machines run Triton 3.6, where Gluon names the barrier ``thread_barrier``; CI installs 3.8,
where it is ``barrier``. Every thread of the program passes ``cta_barrier`` only once all have
reached it (``bar.sync 0``); Triton's own barriers (its membar pass) are the same instruction.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

NEW_BARRIER = gl.constexpr(hasattr(gl, "barrier"))


@gluon.jit
def cta_barrier():
    # every thread of the program past this point
    if NEW_BARRIER:
        gl.barrier()
    else:
        gl.thread_barrier()
