"""Which server holds which parameter: whole tensors, balanced by bytes, the same on every process."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_sync.errors import check_range


def shard_by_bytes(sizes: Sequence[int], num_servers: int) -> list[int]:
    """Assigns each parameter (by its size in bytes) to one of ``num_servers`` servers.

    Greedy "largest first": parameters are taken from the largest to the smallest (ties: lower index first) and
    each goes to the server holding the fewest bytes so far (ties: fewer tensors, then lower server). Whole tensors
    only.

    Guarantees:
        * deterministic: the same sizes give the same assignment on every process;
        * every server gets at least one parameter;
        * the gap between the fullest and the emptiest server is at most the size of the largest parameter, and the
          fullest holds at most ``4/3`` of what the best possible split of whole tensors would put there.

    Args:
        sizes: size in bytes of each parameter, in the order of the parameter list.
        num_servers: number of servers, ``1 <= num_servers <= len(sizes)``.

    Returns:
        For each parameter, in order, the index of its server.

    Raises:
        ValueError: ``num_servers`` is not an integer >= 1 or exceeds the number of parameters (a server would hold
            nothing), or a size is negative.
    """
    check_range("num_servers", num_servers, low=1, integer=True)
    sizes = [int(s) for s in sizes]
    if num_servers > len(sizes):
        raise ValueError(
            f"num_servers={num_servers} exceeds the number of parameter tensors ({len(sizes)}); tensors are not "
            f"split across servers, so use num_servers <= {len(sizes)}"
        )
    if any(s < 0 for s in sizes):
        raise ValueError(f"parameter sizes must be >= 0 bytes, got {sizes}")
    load = [0] * num_servers
    count = [0] * num_servers
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(num_servers), key=lambda k: (load[k], count[k], k))
        owner[index] = server
        load[server] += sizes[index]
        count[server] += 1
    return owner


def shard_indices(owner: Sequence[int], server: int) -> list[int]:
    """The parameter indices (ascending) that ``owner`` (from :func:`shard_by_bytes`) gives to ``server``."""
    return [i for i, k in enumerate(owner) if k == server]
