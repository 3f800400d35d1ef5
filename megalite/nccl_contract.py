"""Where NCCL differs from gloo, as torch 2.13's own source has it: the rules megalite's
communication is written to. The test mode makes gloo keep them through the same megalite code
(`megalite.testing.nccl_like`, which the tests install into `comm`); no trainer code branches
on it.

The contract megalite relies on (distributed_c10d.py, ProcessGroupNCCL):

1. `batch_isend_irecv` returns ONE work for the whole batch on NCCL: a backend that supports
   coalescing runs the ops inside `_coalescing_manager(group, device, async_ops=True)` and returns
   `cm.works`, the single work of `_end_coalescing`. gloo returns one work per op. megalite treats
   a batch as done when every handle it returned is (`comm.P2PBatch`), so either shape works.
2. Sends block: NCCL runs a batch as one grouped kernel that ends when every send has met its
   receive, and a group's batches run one after another on its stream. On gloo a send's `wait()`
   also blocks until the receiver posts, but only posting is ordered: a rank's batches run side
   by side, so a batching that deadlocks on one stream can run there. The emulation completes a
   send only once its receiver has posted the receive, and ends each of a group's operations before
   it issues the group's next (the host waits where NCCL's stream would: at least as strict).
3. `wait()` on NCCL makes the current CUDA stream wait for the work; the host goes on. A received
   tensor may be read on the host only after a synchronising call (`.item()`, `.cpu()`), and step
   timers must be CUDA events, not the host clock (`executor.IntervalTimer`). On gloo (CPU) wait
   blocks the host, which is stricter.
4. Time-outs are per group: `new_group` without `timeout` takes the backend's default (NCCL 10
   min, gloo 30 min), not the world's. `parallel_state` passes the configured one to every group.
5. A batched p2p uses the group's own communicator (`getKeyFromDevice` while NCCL's group is
   open), and a communicator that does not exist yet is created by the first operation on it,
   a step every rank of the group must take (torch's docstring: "if this API is the first
   collective call in the group ... all ranks of the group must participate"). megalite binds
   the device on CUDA (item 8): the world communicator is connected in `init_process_group` and
   every subgroup's is split from it (`split_group`), so no first operation creates one. gloo
   connects every group when it is made, which is what the test mode then matches.
6. Contiguity differs: NCCL's collectives refuse a strided tensor ("Tensors must be
   contiguous") and its p2p only warns and sends the raw memory; gloo's `all_reduce` of a
   strided view silently reduces the first numel elements of its storage, its
   `all_gather_into_tensor` / `reduce_scatter_tensor` accept one, its all-to-all and p2p refuse.
   So `comm` refuses a strided tensor on every backend (`comm.all_reduce`, `post_p2p`, ...);
   callers make messages contiguous (`executor._post`) or hand strided pieces to the calls that
   copy them (`comm._reduce_scatter`). `all_gather_into_tensor` / `reduce_scatter_tensor` need
   output = group size x input on both; megalite sizes collectives by global shapes only.
7. Tensor stashing: NCCL keeps every tensor of an asynchronous op alive until the op completes
   (its work stashes them and records the stream), as gloo's work does; so the executor may drop
   its own reference to a sent activation as soon as the send is posted.
8. `device_id` in `init_process_group` binds the device and connects NCCL eagerly; a subgroup
   made by `new_group` is then split from the world communicator (`ncclCommSplit`), a step every
   world rank takes, members or not (non-members make a no-colour split): one world-wide split
   per group. Without it, each communicator bootstraps through the store on its first
   collective, inside step 1. `parallel_state` binds the device on CUDA and splits each axis's
   groups with one `split_group` call (6 calls where `new_group` would make 528 at 1,024 ranks).
9. `use_local_synchronization=True` lets non-members skip `new_group`, but with a bound device
   they then skip their part of the split and the members hang; on gloo torch names such groups
   by a hash that depends on how many groups each process already made. megalite never uses it.
10. One group's work runs in issue order: ProcessGroupNCCL enqueues every collective and
   batched p2p of a communicator on that communicator's one stream per device, so an operation
   starts only once every earlier one of its group has ended, whatever the host waits for.
   A `P2POp` without a group goes on the world's communicator. Traffic of different purposes
   (pipeline p2p, ring-attention steps, ZeRO gathers and reduce-scatters, all-to-alls) is
   therefore given groups of its own even where the ranks coincide (`parallel_state`), and
   every p2p names its group (`comm.post_p2p`). gloo runs a group's operations side by side,
   which hides this; the emulation keeps the order and records what queued behind what.
"""
