"""torch.distributed: ranks, the group's store, the merge round, node-local transfer, gather, drop-ins."""
