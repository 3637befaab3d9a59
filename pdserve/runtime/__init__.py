"""The model runtime shared by prefill and decode workers.

Path of one request through the runtime (owner of each structure in brackets):

    AddRequest (token ids, KV from elsewhere) ──▶ Sequence [Engine] ──▶ Scheduler admits it for
        a step, under a token budget ──▶ BlockManager gives it blocks (sharing cached prefix
        blocks by content hash, KVFormat; loading the ones it brought; pins in PinTable)
        ──▶ ModelRunner packs the step's tokens into flat tensors (positions, slot mapping,
            block tables) ──▶ LlamaModel forward over the paged KV cache [KVCache, CPU/GPU]
        ──▶ Sampler picks next tokens ──▶ Engine appends them, frees finished sequences.

Worker services reach the engine only through AsyncEngine's typed commands (async_engine.py,
whose docstring follows one request across processes).
"""
