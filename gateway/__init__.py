"""The gateway: the public gRPC entry point that routes each request through prefill and decode.

Modules, one concept each:
- `service`: the grpc.aio servicer; protobuf of the public API stops here.
- `convert`: protobuf <-> dataclass conversion shared by the servicer and the worker calls.
- `prompts`: tokenization (chat template for chats) and request validation.
- `flow`: the path of one request, from tokens to the streamed text (documented there).
- `output`: turns token chunks into text chunks (incremental detokenizer, stop strings, usage).
- `worker_calls`: the RPCs to prefill and decode workers, with their errors made actionable.
- `workers`: pools of worker endpoints with health probing and in-flight counts.
- `router`: the pure policy that picks a worker from a pool.
- `targets`: parsing `host:port` / `dns:///name:port` targets and resolving the latter.
- `limits`: the gateway's bounded in-flight admission.
- `server`: builds all of the above and serves it (`pdserve gateway`).
"""
