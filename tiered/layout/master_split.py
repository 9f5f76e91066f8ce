"""Split fp32 master weights: the bf16 parameter holds the high half, the state keeps 2 bytes, exactly.

A bf16 model with fp32 master weights keeps each weight twice: the master (4 bytes, in the optimizer's
state) and its bf16 rounding (2 bytes, in the model). The rounding already carries the master's sign,
exponent and top mantissa bits, so the state only needs what rounding dropped. With ``p = bf16(master)``
(round to nearest, ties to even, as ``Tensor.to(torch.bfloat16)`` does) and bit patterns read as int32:

    r = bits(master) - bits(p) << 16        r in [-0x8000, 0x8000]

``r`` has 65537 possible values, one more than 16 bits hold: -0x8000 and +0x8000 both occur, and only
on exact ties (the dropped half is 0x8000), where rounding went up (-0x8000) or down to even (+0x8000).
So the state keeps ``lo = r mod 2**16`` (int16) plus one bit per element, set where ``r == -0x8000``;
``lo == -0x8000`` with the bit clear means +0x8000. Joining gives back every finite master bit for bit
(and a NaN for a NaN), so the step stays exactly AdamW over fp32 masters, at 10 bytes a parameter
instead of 12 (``exp_avg`` and ``exp_avg_sq`` stay fp32) and a sixth less disk traffic.

The parameter must hold ``bf16(master)`` when the state is joined: the optimizer writes it there after
every update. Writing to such a parameter between steps therefore changes the high half of its master.

``split``/``join`` are vectorised torch ops on tensors of any one device; ``split_reference``/
``join_reference`` are their element-by-element twins, the oracle of the tests. Ties are rare (about
2**-16 of the elements), so on the CPU their bits are set and read by index, never by a pass over a bit
array. On a GPU finding them by index would make the host wait for the device (``nonzero`` returns a
size), so there the tie bits are packed and unpacked by dense elementwise ops, which cost the GPU a few
microseconds a chunk and never stall the stream. On CUDA with Triton, ``split`` and ``join_params`` are one
kernel each (split_kernels.py): the same bits, a dozen fewer launches for the host to queue.
"""

from __future__ import annotations

import torch

from . import split_kernels
from .sizes import tie_bytes

__all__ = ["TIE", "join", "join_params", "join_reference", "split", "split_reference", "tie_bytes"]

TIE = -0x8000  # lo's value on an exact tie, and r's value when the tie bit is set
_BLOCK = 4096  # elements per block when looking for ties


def split(master: torch.Tensor, p_out: torch.Tensor, lo_out: torch.Tensor, ties_out: torch.Tensor,
          *, dense: bool | None = None) -> None:  # fmt: skip
    """``p_out = bf16(master)``; ``lo_out`` and ``ties_out`` what ``join`` needs to rebuild ``master``.

    master: fp32 [n]; p_out: bf16 [n]; lo_out: int16 [n]; ties_out: uint8 [tie_bytes(n)]. All contiguous,
    on one device. ``dense``: the tie bits' way (None: dense off the CPU, in one Triton kernel on CUDA where
    Triton is there; see the module's doc).
    """
    if dense is None and split_kernels.available(master):
        split_kernels.split(master, p_out, lo_out, ties_out)
        return
    p_out.copy_(master)  # round to nearest even
    # bits(p) << 16 has no low half, so r's low 16 bits are the master's own: one strided copy (the low
    # half of a little-endian fp32 is its first int16).
    lo_out.copy_(master.view(torch.int16)[0::2])
    # On a tie r is -0x8000 when rounding went up, i.e. when p's bits are the master's high half plus one.
    # (A NaN's rounding is quieted, not rounded: its p may differ from the high half otherwise, and it is
    # never a tie.)
    p_hi, m_hi = p_out.view(torch.int16), master.view(torch.int16)[1::2]
    if master.device.type != "cpu" if dense is None else dense:
        up = (lo_out == TIE) & (p_hi - m_hi == 1)
        _pack_bits(up, ties_out)
        return
    ties_out.zero_()
    at = _tie_positions(lo_out)
    if at.numel():
        up = at[p_hi[at] - m_hi[at] == 1]
        if up.numel():
            _set_bits(ties_out, up)


def join(p: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, out: torch.Tensor,
         scratch: torch.Tensor, *, dense: bool | None = None) -> torch.Tensor:  # fmt: skip
    """The fp32 masters that ``split`` took apart: ``out`` (fp32 [n]) from p (bf16), lo (int16) and
    ties (uint8); scratch: int32 [n] (overwritten). ``dense`` as for ``split``."""
    bits = out.view(torch.int32)
    bits.copy_(p.view(torch.int16))
    bits.bitwise_left_shift_(16)
    r = scratch
    r.copy_(lo)  # widen first: an in-place add of an int16 tensor takes a slow mixed-dtype path
    bits.add_(r)
    if lo.device.type != "cpu" if dense is None else dense:
        up = (lo == TIE) & (_unpack_bits(ties, lo.numel()) == 0)  # tie bit clear: r was +0x8000
        bits.add_(up.to(torch.int32).bitwise_left_shift_(16))
        return out
    at = _tie_positions(lo)
    if at.numel():
        up = at[_get_bits(ties, at) == 0]  # tie bit clear: r was +0x8000, not -0x8000
        if up.numel():
            bits[up] += 0x10000
    return out


def join_params(p: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, out: torch.Tensor,
                scratch: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``join``, then each master that does not round to its parameter ``p`` replaced by ``p`` (as fp32): the
    masters of parameters as they are now. A parameter written since its master was split (through ``.data``,
    say) keeps the written value, as torch's AdamW, which updates the parameter itself, would see it; every
    other master is the exact fp32 value ``split`` took apart (it rounds to its parameter by construction).
    One Triton kernel on CUDA; ``join`` and a ``where`` elsewhere."""
    if split_kernels.available(out):
        return split_kernels.join_params(p, lo, ties, out)
    join(p, lo, ties, out, scratch)
    return torch.where(out.to(p.dtype) == p, out, p.float(), out=out)


def _tie_positions(lo: torch.Tensor) -> torch.Tensor:
    """Indices where ``lo == TIE``. TIE is int16's minimum, so a block's min finds the few blocks that
    hold one (a min reduction runs several times faster than a comparison over every element)."""
    n = lo.numel()
    whole = n // _BLOCK * _BLOCK
    found = []
    if whole:
        blocks = lo[:whole].view(-1, _BLOCK)
        rows = torch.nonzero(blocks.amin(dim=1) == TIE).view(-1)
        if rows.numel():
            sub = torch.nonzero(blocks[rows] == TIE)
            found.append(rows[sub[:, 0]] * _BLOCK + sub[:, 1])
    if whole < n:
        found.append(torch.nonzero(lo[whole:] == TIE).view(-1) + whole)
    return torch.cat(found) if found else torch.empty(0, dtype=torch.int64)


def _set_bits(bitmap: torch.Tensor, index: torch.Tensor) -> None:
    """Set bit ``i % 8`` of byte ``i // 8`` for each (distinct) index: work in the number of ties, not n."""
    byte, inverse = torch.unique(index // 8, return_inverse=True)
    mask = torch.bitwise_left_shift(torch.ones_like(index), index % 8)
    # Indices sharing a byte set distinct bits, so summing their masks ORs them.
    acc = torch.zeros(byte.numel(), dtype=torch.int64).index_add_(0, inverse, mask)
    bitmap[byte] |= acc.to(torch.uint8)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return _SHIFTS[device]


def _pack_bits(flags: torch.Tensor, bitmap: torch.Tensor) -> None:
    """Dense: ``bitmap`` (uint8 [tie_bytes(n)]) gets bit ``i % 8`` of byte ``i // 8`` from bool ``flags[i]``."""
    n = flags.numel()
    padded = torch.zeros(bitmap.numel() * 8, dtype=torch.uint8, device=flags.device)
    padded[:n] = flags
    padded = padded.view(-1, 8).bitwise_left_shift_(_shifts(flags.device))
    torch.sum(padded, dim=1, dtype=torch.uint8, out=bitmap)  # distinct bits: the sum is their OR


def _unpack_bits(bitmap: torch.Tensor, n: int) -> torch.Tensor:
    """Dense: bit ``i`` of ``bitmap`` for i < n, as uint8 [n] of 0/1."""
    return bitmap.unsqueeze(1).bitwise_right_shift(_shifts(bitmap.device)).bitwise_and_(1).view(-1)[:n]


def _get_bits(bitmap: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_right_shift(bitmap[index // 8].to(torch.int64), index % 8) & 1


# ---------------------------------------------------------------------------------- serial twins
def split_reference(master: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """Element by element: (p, lo values, indices whose tie bit is set)."""
    p = master.to(torch.bfloat16)
    lo, ties = [], []
    for i, (m, q) in enumerate(zip(master.view(torch.int32).tolist(), p.view(torch.int16).tolist())):
        r = (m & 0xFFFFFFFF) - ((q & 0xFFFF) << 16)
        r = (r + 2**31) % 2**32 - 2**31  # as int32 arithmetic wraps
        lo.append((r + 0x8000) % 0x10000 - 0x8000)
        if r == TIE:
            ties.append(i)
    return p, lo, ties


def join_reference(p: torch.Tensor, lo: list[int], ties: list[int]) -> torch.Tensor:
    tie = set(ties)
    out = []
    for i, (q, low) in enumerate(zip(p.view(torch.int16).tolist(), lo)):
        r = 0x8000 if low == TIE and i not in tie else low
        out.append((((q & 0xFFFF) << 16) + r) & 0xFFFFFFFF)
    return torch.tensor([(b + 2**31) % 2**32 - 2**31 for b in out], dtype=torch.int32).view(torch.float32)
