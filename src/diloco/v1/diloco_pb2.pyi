from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorHeader(_message.Message):
    __slots__ = ("name", "codec", "shape", "block", "payload_bytes", "scale_bytes", "relative")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCALE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    codec: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    block: int
    payload_bytes: int
    scale_bytes: int
    relative: bool
    def __init__(self, name: _Optional[str] = ..., codec: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., block: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., scale_bytes: _Optional[int] = ..., relative: _Optional[bool] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("learner", "fragment", "base_version", "seq", "tokens", "steps", "step_time_s", "sent_at", "tensors", "step", "final", "bulk", "unanswered")
    LEARNER_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    learner: int
    fragment: int
    base_version: int
    seq: int
    tokens: int
    steps: int
    step_time_s: float
    sent_at: float
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    step: int
    final: bool
    bulk: bool
    unanswered: bool
    def __init__(self, learner: _Optional[int] = ..., fragment: _Optional[int] = ..., base_version: _Optional[int] = ..., seq: _Optional[int] = ..., tokens: _Optional[int] = ..., steps: _Optional[int] = ..., step_time_s: _Optional[float] = ..., sent_at: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., step: _Optional[int] = ..., final: _Optional[bool] = ..., bulk: _Optional[bool] = ..., unanswered: _Optional[bool] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("fragment", "version", "ack_seq", "tensors", "next_push_at", "continued", "base_version", "bulk_port", "bulk_ticket")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACK_SEQ_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PUSH_AT_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    BULK_TICKET_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    ack_seq: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    next_push_at: float
    continued: bool
    base_version: int
    bulk_port: int
    bulk_ticket: bytes
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., ack_seq: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., next_push_at: _Optional[float] = ..., continued: _Optional[bool] = ..., base_version: _Optional[int] = ..., bulk_port: _Optional[int] = ..., bulk_ticket: _Optional[bytes] = ...) -> None: ...

class FragmentVersion(_message.Message):
    __slots__ = ("fragment", "version", "push_in_s")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSH_IN_S_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    push_in_s: float
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., push_in_s: _Optional[float] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("versions", "tensors", "layout", "bulk_port", "bulk_ticket")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    BULK_TICKET_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    layout: _containers.RepeatedCompositeFieldContainer[FragmentLayout]
    bulk_port: int
    bulk_ticket: bytes
    def __init__(self, versions: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., layout: _Optional[_Iterable[_Union[FragmentLayout, _Mapping]]] = ..., bulk_port: _Optional[int] = ..., bulk_ticket: _Optional[bytes] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("push", "update", "state", "data")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    push: PushHeader
    update: UpdateHeader
    state: StateHeader
    data: bytes
    def __init__(self, push: _Optional[_Union[PushHeader, _Mapping]] = ..., update: _Optional[_Union[UpdateHeader, _Mapping]] = ..., state: _Optional[_Union[StateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "embedding")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    embedding: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., embedding: _Optional[bool] = ...) -> None: ...

class FragmentLayout(_message.Message):
    __slots__ = ("index", "tensors")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    index: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, index: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class Settings(_message.Message):
    __slots__ = ("strategy", "fragments", "period", "learner_periods", "tau", "alpha", "wait_for_updates", "codec_up", "codec_down", "block", "error_feedback", "learners", "token_budget", "shared_budget", "keep_progress")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    LEARNER_PERIODS_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_UPDATES_FIELD_NUMBER: _ClassVar[int]
    CODEC_UP_FIELD_NUMBER: _ClassVar[int]
    CODEC_DOWN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SHARED_BUDGET_FIELD_NUMBER: _ClassVar[int]
    KEEP_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    fragments: int
    period: int
    learner_periods: _containers.RepeatedScalarFieldContainer[int]
    tau: int
    alpha: float
    wait_for_updates: bool
    codec_up: str
    codec_down: str
    block: int
    error_feedback: bool
    learners: int
    token_budget: int
    shared_budget: bool
    keep_progress: bool
    def __init__(self, strategy: _Optional[str] = ..., fragments: _Optional[int] = ..., period: _Optional[int] = ..., learner_periods: _Optional[_Iterable[int]] = ..., tau: _Optional[int] = ..., alpha: _Optional[float] = ..., wait_for_updates: _Optional[bool] = ..., codec_up: _Optional[str] = ..., codec_down: _Optional[str] = ..., block: _Optional[int] = ..., error_feedback: _Optional[bool] = ..., learners: _Optional[int] = ..., token_budget: _Optional[int] = ..., shared_budget: _Optional[bool] = ..., keep_progress: _Optional[bool] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("index", "address", "fragments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    fragments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., fragments: _Optional[_Iterable[int]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("learner", "host", "tokens_per_step")
    LEARNER_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    learner: int
    host: str
    tokens_per_step: int
    def __init__(self, learner: _Optional[int] = ..., host: _Optional[str] = ..., tokens_per_step: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("learner", "settings", "shard", "shards", "layout", "last_seq", "fragment_last_seq", "bulk_pushes")
    class FragmentLastSeqEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    LEARNER_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    BULK_PUSHES_FIELD_NUMBER: _ClassVar[int]
    learner: int
    settings: Settings
    shard: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    layout: _containers.RepeatedCompositeFieldContainer[FragmentLayout]
    last_seq: int
    fragment_last_seq: _containers.ScalarMap[int, int]
    bulk_pushes: bool
    def __init__(self, learner: _Optional[int] = ..., settings: _Optional[_Union[Settings, _Mapping]] = ..., shard: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., layout: _Optional[_Iterable[_Union[FragmentLayout, _Mapping]]] = ..., last_seq: _Optional[int] = ..., fragment_last_seq: _Optional[_Mapping[int, int]] = ..., bulk_pushes: _Optional[bool] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("learner", "observer", "after_seq", "fragments", "bulk")
    LEARNER_FIELD_NUMBER: _ClassVar[int]
    OBSERVER_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    learner: int
    observer: bool
    after_seq: int
    fragments: _containers.RepeatedScalarFieldContainer[int]
    bulk: bool
    def __init__(self, learner: _Optional[int] = ..., observer: _Optional[bool] = ..., after_seq: _Optional[int] = ..., fragments: _Optional[_Iterable[int]] = ..., bulk: _Optional[bool] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("duplicate", "clipped", "bulk_port", "bulk_ticket", "next_ticket")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    BULK_TICKET_FIELD_NUMBER: _ClassVar[int]
    NEXT_TICKET_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    clipped: bool
    bulk_port: int
    bulk_ticket: bytes
    next_ticket: bytes
    def __init__(self, duplicate: _Optional[bool] = ..., clipped: _Optional[bool] = ..., bulk_port: _Optional[int] = ..., bulk_ticket: _Optional[bytes] = ..., next_ticket: _Optional[bytes] = ...) -> None: ...

class UpdatesRequest(_message.Message):
    __slots__ = ("learner", "holds", "bulk")
    LEARNER_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    learner: int
    holds: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    bulk: bool
    def __init__(self, learner: _Optional[int] = ..., holds: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., bulk: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner", "tokens", "steps", "step_time_s", "due_in_s")
    LEARNER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DUE_IN_S_FIELD_NUMBER: _ClassVar[int]
    learner: int
    tokens: int
    steps: int
    step_time_s: float
    due_in_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, learner: _Optional[int] = ..., tokens: _Optional[int] = ..., steps: _Optional[int] = ..., step_time_s: _Optional[float] = ..., due_in_s: _Optional[_Iterable[float]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("stop", "tokens_reported")
    STOP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_REPORTED_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    tokens_reported: int
    def __init__(self, stop: _Optional[bool] = ..., tokens_reported: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("learner", "finished")
    LEARNER_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    learner: int
    finished: bool
    def __init__(self, learner: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("shard", "initialised", "finished", "versions", "rounds", "tokens_reported", "alive", "report_json", "run")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    INITIALISED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_REPORTED_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    REPORT_JSON_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    shard: int
    initialised: bool
    finished: bool
    versions: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    rounds: int
    tokens_reported: int
    alive: _containers.RepeatedScalarFieldContainer[int]
    report_json: str
    run: str
    def __init__(self, shard: _Optional[int] = ..., initialised: _Optional[bool] = ..., finished: _Optional[bool] = ..., versions: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., rounds: _Optional[int] = ..., tokens_reported: _Optional[int] = ..., alive: _Optional[_Iterable[int]] = ..., report_json: _Optional[str] = ..., run: _Optional[str] = ...) -> None: ...
