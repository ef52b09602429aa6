"""Pure-Python scheduling: requests, the KV block and state slot allocators, and the scheduler
that turns waiting and running requests into batches. Nothing here touches a tensor."""
