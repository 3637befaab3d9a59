from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SharedSegment(_message.Message):
    __slots__ = ("name", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: bytes
    def __init__(self, name: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class AttachSegmentResponse(_message.Message):
    __slots__ = ("attached", "reason")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    attached: bool
    reason: str
    def __init__(self, attached: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class PutBlockRequest(_message.Message):
    __slots__ = ("request_id", "block_hash", "data", "segment", "offset", "length")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_hash: bytes
    data: bytes
    segment: SharedSegment
    offset: int
    length: int
    def __init__(self, request_id: _Optional[str] = ..., block_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., segment: _Optional[_Union[SharedSegment, _Mapping]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("stored", "already_present", "rejected")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    rejected: int
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("request_id", "block_hashes", "segment", "offset", "capacity")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    segment: SharedSegment
    offset: int
    capacity: int
    def __init__(self, request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., segment: _Optional[_Union[SharedSegment, _Mapping]] = ..., offset: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class KVBlock(_message.Message):
    __slots__ = ("block_hash", "data", "missing", "in_segment", "offset", "length")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    IN_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    data: bytes
    missing: bool
    in_segment: bool
    offset: int
    length: int
    def __init__(self, block_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., missing: _Optional[bool] = ..., in_segment: _Optional[bool] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes", "with_residency")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    WITH_RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    with_residency: bool
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., with_residency: _Optional[bool] = ...) -> None: ...

class WorkerPrefix(_message.Message):
    __slots__ = ("worker_id", "prefix_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    prefix_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., prefix_blocks: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_blocks", "present", "residency")
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    present: _containers.RepeatedScalarFieldContainer[bool]
    residency: _containers.RepeatedCompositeFieldContainer[WorkerPrefix]
    def __init__(self, prefix_blocks: _Optional[int] = ..., present: _Optional[_Iterable[bool]] = ..., residency: _Optional[_Iterable[_Union[WorkerPrefix, _Mapping]]] = ...) -> None: ...

class ResidencyReport(_message.Message):
    __slots__ = ("worker_id", "added", "removed", "reset")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    added: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    reset: bool
    def __init__(self, worker_id: _Optional[str] = ..., added: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., reset: _Optional[bool] = ...) -> None: ...

class ResidencyAck(_message.Message):
    __slots__ = ("need_reset",)
    NEED_RESET_FIELD_NUMBER: _ClassVar[int]
    need_reset: bool
    def __init__(self, need_reset: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "drop")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    drop: bool
    def __init__(self, request_id: _Optional[str] = ..., drop: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class KVStoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStoreStats(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "num_blocks", "num_pinned", "num_leases", "puts", "gets", "hits", "misses", "evictions", "bytes_in", "bytes_out", "backend_hits", "backend_errors", "backend_up")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_HITS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_ERRORS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_UP_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    num_pinned: int
    num_leases: int
    puts: int
    gets: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    backend_hits: int
    backend_errors: int
    backend_up: bool
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_pinned: _Optional[int] = ..., num_leases: _Optional[int] = ..., puts: _Optional[int] = ..., gets: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., backend_hits: _Optional[int] = ..., backend_errors: _Optional[int] = ..., backend_up: _Optional[bool] = ...) -> None: ...
