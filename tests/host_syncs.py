"""What a piece of code makes the host wait for, counted on a CPU: every aten op that reads a value
back (.item(), bool(), int()) or whose output's shape depends on the data (nonzero, unique, boolean-
mask indexing), each of which stalls a GPU's host until the device catches up, and the collectives
by name. Used by the distributed tests' scripts: `with HostSyncs() as seen: ...`."""
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# a value read back, or an output shape known only once the data is
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten._unique2.default,
         aten.unique_dim.default, aten.unique_consecutive.default, aten.masked_select.default}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


def _bool_index(func, args):
    """x[mask] and x[mask] = y: a boolean index is a nonzero() inside the op."""
    return func in INDEXING and any(t is not None and t.dtype == torch.bool for t in args[1])


class HostSyncs(TorchDispatchMode):
    """syncs: the ops above, in order; collectives: c10d ops by name (allreduce_, _allgather_base_, ...).
    Tensor.tolist() reads memory without an op: counted by patching it while the mode is on."""

    def __init__(self):
        super().__init__()
        self.syncs, self.collectives = [], Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS or _bool_index(func, args):
            self.syncs.append(str(func))
        if func.namespace == "c10d":
            self.collectives[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: (self.syncs.append("tolist"), self.tolist(t))[1]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)
