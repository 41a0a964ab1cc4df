"""The Tinker wire format the SDK speaks, decoded and encoded with the SDK's own schema.

``forward_backward`` arrives as a protobuf ``ForwardBackwardRequest`` (``tinker.proto``), and its
result and a sample's go back as protobuf ``ForwardBackwardOutput`` / ``SampleResponse`` (the SDK
0.38 reads those two only as protobuf); everything else is JSON parsed by the SDK's pydantic types.
Every check here names the field the SDK user set, with the bad value and the fix, as an
:class:`ApiError` the routes answer with its HTTP status (400 -> ``tinker.BadRequestError``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

LOSSES = ("cross_entropy", "importance_sampling", "ppo")
# the loss_fn_inputs each loss reads (weights is optional for cross_entropy: all ones)
LOSS_INPUTS = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
OPTIONAL_INPUTS = {"cross_entropy": ("weights",)}
PPO_CONFIG = ("clip_low_threshold", "clip_high_threshold")


class ApiError(Exception):
    """A request the service refuses: ``status`` is the HTTP status the SDK maps to its error
    type (400 BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError, 404
    NotFoundError); the message names the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def bad(message: str) -> ApiError:
    """HTTP 400: a malformed request (BadRequestError in the SDK)."""
    return ApiError(400, message)


@dataclass
class Datum:
    """One training example: ``tokens`` [N] in, and its loss inputs, each [N] (position ``i``
    scores ``target_tokens[i]`` given ``tokens[: i + 1]``)."""

    tokens: np.ndarray  # [N] int64
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [N]


@dataclass
class ForwardBackward:
    """A decoded ``/forward_backward`` request."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]

    @property
    def n_tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    """A dense 1-D array of a proto Tensor (a sparse CSR one is expanded)."""
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise bad(f"{where}: dtype {msg.dtype} is not float32 or int64")
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        shape = list(msg.shape)
        if len(shape) != 2:
            raise bad(f"{where}: a sparse tensor needs a 2-D shape, got {shape}")
        dense = np.zeros(shape, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        values = np.frombuffer(csr.values, dtype=dtype)
        for r in range(len(crow) - 1):
            dense[r, cols[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        arr = dense
    else:
        arr = np.frombuffer(msg.dense, dtype=dtype)
    if arr.ndim != 1 and not (arr.ndim == 2 and 1 in arr.shape):
        raise bad(f"{where}: expected one value per token, got shape {list(arr.shape)}")
    return arr.reshape(-1)


def _datum(msg: pb.Datum, i: int) -> Datum:
    tokens = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind not in (None, "encoded_text"):
            raise bad(
                f"data[{i}].model_input.chunks[{j}]: {kind} chunks are not supported; "
                "send token chunks (ModelInput.from_ints)"
            )
        tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    ids = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
    inputs = {
        name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}")
        for name, t in msg.loss_fn_inputs.items()
    }
    return Datum(ids, inputs)


def decode_forward_backward(body: bytes) -> ForwardBackward:
    """Parse a protobuf ``ForwardBackwardRequest`` body (not yet checked against a model)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # google.protobuf.message.DecodeError
        raise bad(f"forward_backward: body is not a ForwardBackwardRequest protobuf: {e}") from None
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "text":
            raise bad(f"loss_fn_config.{k}: {v.text!r} is text; the built-in losses take numbers")
        config[k] = float(v.number)
    data = [_datum(d, i) for i, d in enumerate(msg.data)]
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def check_forward_backward(req: ForwardBackward, vocab_size: int, max_batch_tokens: int) -> None:
    """Raise :class:`ApiError` (400) naming the first bad field of ``req``."""
    if req.loss_fn not in LOSSES:
        raise bad(
            f"loss_fn: {req.loss_fn!r} is not served here; use one of {', '.join(LOSSES)} "
            "(or forward_backward_custom, which runs its loss on the client)"
        )
    if not req.data:
        raise bad("data: empty; send at least one Datum")
    if req.n_tokens > max_batch_tokens:
        raise bad(
            f"data: {req.n_tokens} tokens in one request, over tinker.max_batch_tokens="
            f"{max_batch_tokens}; send fewer or shorter datums per call (or raise the limit)"
        )
    known = set(PPO_CONFIG) if req.loss_fn == "ppo" else set()
    for k, v in req.config.items():
        if k not in known:
            raise bad(f"loss_fn_config.{k}: not a setting of {req.loss_fn}; known: {sorted(known)}")
        if not math.isfinite(v) or v < 0:
            raise bad(f"loss_fn_config.{k}: must be a finite number >= 0, got {v}")
    for i, d in enumerate(req.data):
        _check_datum(d, i, req.loss_fn, vocab_size)


def _check_datum(d: Datum, i: int, loss_fn: str, vocab_size: int) -> None:
    n = len(d.tokens)
    if n == 0:
        raise bad(f"data[{i}].model_input: no tokens")
    if d.tokens.min() < 0 or d.tokens.max() >= vocab_size:
        raise bad(f"data[{i}].model_input: token ids must be in [0, {vocab_size}) for this model")
    allowed = (*LOSS_INPUTS[loss_fn], *OPTIONAL_INPUTS.get(loss_fn, ()))
    for name in LOSS_INPUTS[loss_fn]:
        if name not in d.inputs:
            raise bad(f"data[{i}].loss_fn_inputs.{name}: missing; {loss_fn} needs {allowed}")
    for name, arr in d.inputs.items():
        where = f"data[{i}].loss_fn_inputs.{name}"
        if name not in allowed:
            raise bad(f"{where}: not an input of {loss_fn}; it reads {allowed}")
        if len(arr) != n:
            raise bad(f"{where}: {len(arr)} values for {n} model_input tokens; give one per token")
        if name == "target_tokens":
            if arr.min() < 0 or arr.max() >= vocab_size:
                raise bad(f"{where}: token ids must be in [0, {vocab_size}) for this model")
        elif not np.isfinite(arr).all():
            pos = int(np.flatnonzero(~np.isfinite(arr))[0])
            raise bad(f"{where}: {arr[pos]} at position {pos}; every value must be finite")


def _batched(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    """Per-datum 1-D float32 arrays as one BatchedTensor (byte offsets, as the SDK slices it)."""
    sizes = [a.nbytes for a in arrays]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    data = b"".join(a.tobytes() for a in arrays)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def encode_forward_backward(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """A protobuf ``ForwardBackwardOutput``: one float32 array per datum and field."""
    record = pb.ArrayRecord(num_datums=len(outputs))
    for name in outputs[0] if outputs else []:
        arrays = [o[name].astype(np.float32) for o in outputs]
        record.fields[name].CopyFrom(_batched(arrays))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


@dataclass
class Sequence:
    """One sampled sequence: tokens, their logprobs and why it stopped (stop or length)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


def encode_sample(seqs: list[Sequence], prompt_logprobs: list[float | None] | None) -> bytes:
    """A protobuf ``SampleResponse``; a prompt position with no logprob (the first) is NaN."""
    msg = pb.SampleResponse()
    for s in seqs:
        msg.sequences.append(
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes(),
            )
        )
    if prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return msg.SerializeToString()
