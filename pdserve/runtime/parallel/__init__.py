"""Tensor (and pipeline) parallelism of the runtime's model over torch.distributed (gloo on CPUs, NCCL on GPUs).

One process per rank. Rank 0 is the worker: gRPC server, scheduler, sampler, and the driver of
the group; ranks 1..N-1 (`follower`) only run the model. Every step rank 0 broadcasts the step's
inputs (`protocol`), all ranks run the same forward on their shard in lockstep (`tp_model`: heads
and MLP columns split, one all-reduce after o and after down, vocabulary-parallel embedding and
head, logits gathered to rank 0), and rank 0 samples. Each rank's paged KV cache holds its own KV
heads; rank 0 sees the whole cache through `kv_shard.ShardedKVCache`, which gathers and scatters
blocks in the canonical layout (all KV heads), so the KV store, the wire and workers of any other
degree never see a shard. The pieces:

    group     process-group setup (file rendezvous, collective timeout), timed collectives
    sharding  which heads / columns / vocabulary rows a rank holds; splitting dense and GPTQ weights
    protocol  the command channel from rank 0 to the others (step inputs, logits, blocks, heartbeat)
    tp_model  the sharded model (a LlamaModel subclass) and rank 0's driver around it
    kv_shard  rank 0's canonical view of the sharded paged cache
    follower  the loop of ranks 1..N-1
    launch    starting the ranks, watching them, and putting the driver into an Engine

Pipeline parallelism (`--pipeline-parallel-size M`) runs on the same group, launch and channel:
each rank a stage of contiguous layers (TP x PP: each stage a tensor-parallel group of its own),
hidden states sent stage to stage point-to-point in micro-batches, logits back to rank 0:

    stages    which layers a stage holds; its weights
    pp_model  the stage model, the micro-batched pipeline step, rank 0's driver, a stage's loop
    pp_kv     rank 0's canonical view of the stages' caches (all layers, all KV heads)

See docs/parallelism.md.
"""
