"""The kernel families and the one launch layer they share.

``options`` (every knob), ``launch`` (host helpers, allocation, module and plan caches),
``tables`` (block-mask tables as the kernels read them), ``plans`` (validation and plan caches),
and one module per family: ``forward``, ``backward``, ``decode``.
"""
