"""Mixture of experts: replicated router, expert banks sharded along the intermediate axis,
kernels that run a bank, backends that decide where its experts live (resident, offloaded behind
a GPU cache, on the CPU), and the block that adds the gated shared expert before one reduce."""
