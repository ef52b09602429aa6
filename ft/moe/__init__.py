"""Mixture of experts: replicated router, expert banks sharded along the intermediate axis,
kernels that run a bank, and the block that adds the gated shared expert before one reduce."""
