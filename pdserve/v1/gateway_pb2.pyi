from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "session_id", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    sampling: _common_pb2.SamplingParams
    session_id: str
    model: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("request_id", "messages", "sampling", "session_id", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: _common_pb2.SamplingParams
    session_id: str
    model: str
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "usage", "deployment")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: str
    usage: _common_pb2.Usage
    deployment: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., deployment: _Optional[str] = ...) -> None: ...

class FeedbackRequest(_message.Message):
    __slots__ = ("request_id", "score", "comment")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    COMMENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    score: float
    comment: str
    def __init__(self, request_id: _Optional[str] = ..., score: _Optional[float] = ..., comment: _Optional[str] = ...) -> None: ...

class FeedbackResponse(_message.Message):
    __slots__ = ("experiment", "arm", "reward", "pending")
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    experiment: str
    arm: str
    reward: float
    pending: bool
    def __init__(self, experiment: _Optional[str] = ..., arm: _Optional[str] = ..., reward: _Optional[float] = ..., pending: _Optional[bool] = ...) -> None: ...

class ExperimentReportRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArmReport(_message.Message):
    __slots__ = ("experiment", "arm", "policy", "requests", "share", "rewarded", "reward_mean", "reward_ci95", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "errors", "feedback", "allocation", "up")
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    REWARDED_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_CI95_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_P50_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_P99_S_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    experiment: str
    arm: str
    policy: str
    requests: int
    share: float
    rewarded: int
    reward_mean: float
    reward_ci95: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    errors: int
    feedback: int
    allocation: float
    up: bool
    def __init__(self, experiment: _Optional[str] = ..., arm: _Optional[str] = ..., policy: _Optional[str] = ..., requests: _Optional[int] = ..., share: _Optional[float] = ..., rewarded: _Optional[int] = ..., reward_mean: _Optional[float] = ..., reward_ci95: _Optional[float] = ..., ttft_p50_s: _Optional[float] = ..., ttft_p99_s: _Optional[float] = ..., tpot_p50_s: _Optional[float] = ..., tpot_p99_s: _Optional[float] = ..., errors: _Optional[int] = ..., feedback: _Optional[int] = ..., allocation: _Optional[float] = ..., up: _Optional[bool] = ...) -> None: ...

class ExperimentReportResponse(_message.Message):
    __slots__ = ("arms",)
    ARMS_FIELD_NUMBER: _ClassVar[int]
    arms: _containers.RepeatedCompositeFieldContainer[ArmReport]
    def __init__(self, arms: _Optional[_Iterable[_Union[ArmReport, _Mapping]]] = ...) -> None: ...
