"""The model runtime shared by prefill and decode workers.

Path of one request through the runtime (owner of each structure in brackets):

    token ids ──▶ Sequence [Engine] ──▶ Scheduler picks it for a step, under a token budget
        ──▶ BlockManager gives it blocks (reusing cached prefix blocks by content hash)
        ──▶ ModelRunner packs the step's tokens into flat tensors (positions, slot mapping,
            block tables) ──▶ LlamaModel forward over the paged KV cache [KVCache, CPU/GPU]
        ──▶ Sampler picks next tokens ──▶ Engine appends them, frees finished sequences.
"""
