"""Process groups and the pre-collective agreement checks: errors on every rank, not hangs.

Before a collective that could deadlock on a mismatch, every rank gathers a digest of a small
description of its call (which operation, shapes, lengths, dtype, method, mask and mod keys) and
whether it found a local error, in one all-gather; only if the digests differ, or any rank found
an error, do the ranks gather the descriptions themselves (``all_gather_object``), so that every
rank raises the same `DistributedMismatchError` naming what differs. Calls check once per
description: a description seen before (on this rank) is not gathered again. A build of a block
mask that repeats the arguments of one the ranks agreed on takes part in its gather and reads it
at the rank's next flexattn call in the group (`launch_table`, `flexattn.distributed.masks.verify`);
every rank decides the same from a gather (`_decide`), and where any rank reads later the ranks
raise by themselves instead of gathering descriptions. Every gather of a group has the same size
(`WIDTH` table entries per rank, zeros where unused), so that ranks in different flexattn
operations meet in gathers of one size and raise.
"""

from __future__ import annotations

import hashlib
import socket
import weakref

import torch
import torch.distributed as dist

from flexattn.kernels import launch
from flexattn.lru import LRU


class DistributedMismatchError(ValueError):
    """Ranks called a collective flexattn operation with inputs that do not agree."""


class Deferred(DistributedMismatchError):
    """A mismatch found in a gather that some rank reads later (`launch_table`): every rank raises
    it at the same later call, not at once."""


def resolve_group(group_or_mesh) -> dist.ProcessGroup:
    """A process group from a ProcessGroup, a 1-D DeviceMesh, or None (the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flexattn.distributed needs torch.distributed initialised "
                           "(torch.distributed.init_process_group, or torchrun)")
    if group_or_mesh is None:
        return dist.group.WORLD
    if isinstance(group_or_mesh, dist.ProcessGroup):
        return group_or_mesh
    get_group = getattr(group_or_mesh, "get_group", None)
    if get_group is not None:  # DeviceMesh
        if group_or_mesh.ndim != 1:
            raise ValueError(f"group_or_mesh: a DeviceMesh must be 1-D here (pass mesh['cp'] for its "
                             f"context-parallel dimension), got {group_or_mesh.ndim} dimensions")
        return get_group()
    raise TypeError(f"group_or_mesh must be a ProcessGroup, a 1-D DeviceMesh or None, got "
                    f"{type(group_or_mesh).__name__}")


_RING: dict[str, tuple] = {}  # group name: weak references to the group and its two ring groups


def ring_groups(group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The two process groups the ring sends through: K and dK through the first, V and dV
    through the second. For the default group, two groups of its own over all ranks, made once (by
    every rank: `create_block_mask` calls it), whose NCCL streams have high priority; for any other
    group, that group twice.

    Why two: NCCL runs a communicator's point-to-point transfers to one peer on a few channels,
    and two communicators carry more (K and V of 134 MB each to the next of 4 H100s: 1.70 ms
    through one communicator, 0.96 ms through two; 0.98 and 0.85 ms on 2).
    Why high priority: a transfer kernel that becomes ready while an attention kernel is running
    gets SMs only once that kernel has handed out all its programs (CUDA gives a later kernel's
    programs SMs in order, unless its stream has a higher priority), so the next shard's transfer
    would wait for the current shard's compute instead of overlapping it.
    A subgroup gets neither: `torch.distributed.new_group` is a collective of every rank, and
    groups made by their members alone are named after how many groups each member has made, so
    that ranks that made different ones would wait for each other for ever. (A subgroup made with
    ``ProcessGroupNCCL.Options(is_high_priority_stream=True)`` has the priority.)

    The cache holds the groups weakly: torch.distributed owns them, and `destroy_process_group`
    frees them then and there. (A group kept alive past it would keep its connections and threads
    until the interpreter's own teardown frees it.)"""
    if group is not dist.group.WORLD:
        return group, group
    made = [ref() for ref in _RING.get(group.group_name, ())]
    if not made or made[0] is not group or None in made:  # (a default group made again after destroy_process_group)
        backend = dist.get_backend(group)
        options = None
        if "nccl" in backend_of(group):
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
        made = [group, *(dist.new_group(backend=backend, pg_options=options, group_desc=f"flexattn ring {i}")
                         for i in range(2))]
        _RING[group.group_name] = tuple(map(weakref.ref, made))
    return made[1], made[2]


def backend_of(group: dist.ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


def backend_error(group: dist.ProcessGroup, device: torch.device, method: str) -> str:
    """Why ``group``'s backend cannot run ``method`` on tensors on ``device`` ("" if it can)."""
    backend = backend_of(group)
    if device.type == "cuda":
        if "nccl" not in backend:
            return (f"method={method!r} on CUDA tensors needs a process group with the NCCL backend, "
                    f"got {backend!r}")
    elif device.type == "cpu":
        if "gloo" not in backend:
            return f"method={method!r} on CPU tensors needs a process group with the gloo backend, got {backend!r}"
    else:
        return f"flexattn.distributed runs on CUDA (NCCL) or CPU (gloo) tensors, got {device.type}"
    return ""


def _digest(value) -> int:
    """A signed 64-bit digest of ``repr(value)``, equal in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


# table entries a gather carries per rank of the group (`agree_table`'s widest table)
WIDTH = 4


def agree_table(group: dist.ProcessGroup, what: str, fields: dict, local_error: str, table: torch.Tensor | None,
                can: bool = True) -> tuple[list[list[int]], bool]:
    """`agree` and a gather of an integer ``table`` of up to ``WIDTH`` entries per rank of the
    group (on any device; None where ``local_error``) in one collective and one host sync:
    ``(every rank's table, whether every rank runs on this host and passed can=True)``."""
    return _decide(group, what, fields, local_error, _launch(group, what, fields, local_error, can, table),
                   0 if table is None else table.numel())


def _decide(group: dist.ProcessGroup, what: str, fields: dict | None, local_error: str, every: torch.Tensor,
            n: int) -> tuple[list[list[int]], bool]:
    """What every rank decides from the same gather ``every`` (read here: a host sync):
    ``(tables of n entries, copy engines)``, or the same error on every rank. Where a rank launched
    its gather to read it later (`launch_table`), the ranks raise by themselves instead of
    gathering descriptions."""
    rows = every.view(group.size(), -1).tolist()
    if not all(r[0] for r in rows) or len({r[1] for r in rows}) > 1:
        if any(r[4] for r in rows):
            raise Deferred(_summary(what, rows, local_error))
        _compare(group, what, fields, local_error)  # (raises on every rank, naming what differs)
    tables = [r[_HEADER:_HEADER + n] for r in rows]
    return tables, len({r[2] for r in rows}) == 1 and all(r[3] for r in rows)


class Pending:
    """The gather of a build launched by a rank that reads it later (`launch_table`)."""

    def __init__(self, group: dist.ProcessGroup, what: str, every: torch.Tensor, n: int):
        self.what, self.n, self.done = what, n, None
        if every.is_cuda:  # (copied to pinned memory behind the gather: the read waits for no later work)
            self.every, self.done = _pinned(group, every)
            self.every.copy_(every, non_blocking=True)
            self.done.record()
        else:
            self.every = every

    def check(self, group: dist.ProcessGroup) -> tuple[list[list[int]], bool]:
        """Reads the gather in ``group`` (waiting for it and the work queued before it): what every
        rank decides from it (`_decide`), or its error, raised on this rank."""
        if self.done is not None:
            self.done.synchronize()
        return _decide(group, self.what, None, "", self.every, self.n)


# group -> (device, pinned buffer, event) of its gathers read later: a rank reads each such gather
# before it launches the next one of the group (`flexattn.distributed.masks.verify`), so one buffer
# serves them all
_PINNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _pinned(group: dist.ProcessGroup, every: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    found = _PINNED.get(group)
    if found is None or found[0] != every.device or found[1].shape != every.shape:
        found = _PINNED[group] = (every.device, torch.empty(every.shape, dtype=every.dtype, pin_memory=True),
                                  torch.cuda.Event())
    else:  # (a gather left unread where an earlier build's error was raised: its copy ends first)
        found[2].synchronize()
    return found[1:]


def launch_table(group: dist.ProcessGroup, what: str, fields: dict, local_error: str, table: torch.Tensor | None,
                 can: bool, fixed: bool = False) -> Pending:
    """The gather of `agree_table`, launched and not read, for a rank that repeats the arguments
    of a build the ranks agreed on: it takes part in the gather with no host sync and reads it
    later (`Pending.check`). Every rank decides the same from the gather: a rank that reads its
    gather at once and finds a mismatch raises by itself (the ranks that read later are not there
    to gather descriptions). ``fixed``: ``table`` is a tensor whose values do not change (a kept
    classification's ranges), so what this rank sends is made once per description and table."""
    every = _launch(group, what, fields, local_error, can, table, later=True, fixed=fixed)
    return Pending(group, what, every, 0 if table is None else table.numel())


def _launch(group: dist.ProcessGroup, what: str, fields: dict, local_error: str, can: bool = True,
            table: torch.Tensor | None = None, later: bool = False, fixed: bool = False) -> torch.Tensor:
    """The all-gather of every rank's ``[no local error, digest of what and fields, digest of the
    host name, can, reads later, *table]``, the table padded with zeros to ``WIDTH`` entries per
    rank of the group (all zeros where None or ``local_error``), on the device the group's backend
    sends from; launched, not read."""
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend_of(group) else torch.device("cpu")
    width = WIDTH * group.size()
    if table is not None and table.numel() > width:
        raise ValueError(f"{what}: a table of {table.numel()} entries is wider than a gather's {width}")

    def make():  # (the header, then a table of zeros; from pinned memory: a copy from pageable memory syncs the stream)
        return launch.to_device([0 if local_error else 1, _digest((what, sorted(fields.items()))), _HOST,
                                 int(bool(can)), int(later)] + [0] * width, torch.int64, device)

    key = (what, tuple(fields.items()), bool(local_error), bool(can), later, width, device)
    try:  # (made once per description: a repeated build sends it from the device as it is)
        mine = _HEADERS.get_or_make(key, make)
    except TypeError:  # (a value that cannot be hashed, such as a list passed for B: no entry)
        key, mine = None, make()
    if table is not None and not local_error:  # (int64: cat promotes the table)
        header = mine

        def sent():
            return table, torch.cat([header[:_HEADER], table.flatten().to(device), header[_HEADER + table.numel():]])

        # (a fixed table by its id: the entry holds the table, so that no other tensor takes that id)
        mine = (_SENT.get_or_make((key, id(table)), sent) if fixed and key is not None else sent())[1]
    every = torch.empty(group.size() * mine.numel(), dtype=torch.int64, device=device)
    _gather_single(every, mine, group=group)
    return every


def _summary(what: str, rows: list[list[int]], local_error: str = "") -> str:
    """What the gathered digests show, where the descriptions are not gathered."""
    failed = [i for i, r in enumerate(rows) if not r[0]]
    differ = [i for i, r in enumerate(rows) if r[0] and r[1] != rows[0][1]]
    parts = [f"this rank: {local_error}"] if local_error else []
    if failed:
        parts.append(f"rank(s) {failed} failed (their errors are raised there)")
    if differ:
        parts.append(f"the arguments of rank(s) {differ} differ from rank 0's")
    later = [i for i, r in enumerate(rows) if r[4]]
    return (f"{what}: the ranks disagree ({'; '.join(parts)}); rank(s) {later} repeated the arguments of a "
            f"build the ranks had agreed on, so every rank raises at its next create_block_mask or "
            f"flex_attention in the group")


# (what, fields, no local error, can, reads later, width, device) -> the header and zeros a gather sends
_HEADERS = LRU(256)
# (that key, id of a fixed table) -> (the table, the header with the table that a gather sends: `launch_table`)
_SENT = LRU(64)
_HEADER = 5
_HOST = _digest(socket.gethostname())
# (one output tensor: torch 2.13 names it all_gather_single, earlier releases all_gather_into_tensor)
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# group -> the descriptions this rank agreed on in it (an entry goes with its group: a group made
# later at the same address is not taken for one that agreed)
_AGREED: "weakref.WeakKeyDictionary[dist.ProcessGroup, set]" = weakref.WeakKeyDictionary()
_AGREED_LIMIT = 4096  # descriptions kept per group


def agree(group: dist.ProcessGroup, what: str, fields: dict, local_error: str = "", cache: bool = True) -> None:
    """Every rank of ``group`` passes equal ``fields`` (name -> value) and no ``local_error``,
    else every rank raises the same `DistributedMismatchError` naming ``what``.

    With ``cache``, a description this rank agreed on before in ``group`` skips the gather (all
    ranks must then see the same description again, which a matching earlier agreement makes
    likely)."""
    token = (what, tuple(fields.items()), local_error) if cache else None
    if token is not None and token in _AGREED.get(group, ()):
        return
    _decide(group, what, fields, local_error, _launch(group, what, fields, local_error), 0)
    if token is not None:
        seen = _AGREED.setdefault(group, set())
        if len(seen) >= _AGREED_LIMIT:
            seen.clear()
        seen.add(token)


def _compare(group: dist.ProcessGroup, what: str, fields: dict, local_error: str) -> None:
    """The descriptions and errors of every rank, gathered (every rank calls it after digests that
    differ or an error anywhere): raises the same `DistributedMismatchError` on every rank, unless
    the descriptions turn out equal (a value whose repr differs between processes)."""
    size = group.size()
    gathered: list = [None] * size
    dist.all_gather_object(gathered, (local_error, what, fields), group=group)
    errors = [f"rank {r}: {err}" for r, (err, _, _) in enumerate(gathered) if err]
    if errors:
        raise DistributedMismatchError(f"{what}: " + "; ".join(errors))
    calls = [theirs for _, theirs, _ in gathered]
    if len(set(calls)) > 1:  # (ranks in different operations: one repeated a call the others did not)
        detail = ", ".join(f"rank {r} in {call}" for r, call in enumerate(calls))
        raise DistributedMismatchError(f"{what}: the ranks called different collective operations ({detail}): "
                                       f"every rank makes the same flexattn.distributed calls, in the same order")
    first = gathered[0][2]
    for r, (_, _, theirs) in enumerate(gathered[1:], start=1):
        if theirs != first:
            diff = [k for k in first.keys() | theirs.keys() if first.get(k) != theirs.get(k)]
            detail = ", ".join(f"{k}: rank 0 has {first.get(k)!r}, rank {r} has {theirs.get(k)!r}"
                               for k in sorted(diff))
            raise DistributedMismatchError(f"{what}: the ranks disagree ({detail})")
