"""How the optimizer's state is laid out, as pure functions of shapes and dtypes: no I/O, no streams.

- ``chunking``: parameters cut into chunks of whole rows (``Piece``), each chunk one record, and the record
  formats (``RecordFormat``: fp32, bf16 or 8-bit moments, split or full masters) with their byte sizes;
- ``master_split``: fp32 masters kept as the bf16 parameter plus a stored low half (bit-exact);
- ``moments_codec``: 8-bit blockwise codes for ``exp_avg`` and ``exp_avg_sq``;
- ``split_kernels``: the Triton kernels behind ``master_split`` on CUDA.

The store (``tiered.store``) holds the records; the optimizer (``tiered.optim``) reads and writes them through
these layouts.
"""
