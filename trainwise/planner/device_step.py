"""The planner's step time: record the step's operators (trainwise.measure.record), time the matmul and
attention calls this device has not timed yet (trainwise.measure.kernels), price the step
(trainwise.cost.steptime). The cost layer only prices; measuring happens here, before it.
"""

from __future__ import annotations

from trainwise.config import ModelConfig
from trainwise.cost.ops import Op
from trainwise.cost.steptime import StepTime, step_time
from trainwise.hardware.profile import Profile
from trainwise.measure.kernels import time_new_kernels
from trainwise.measure.record import param_numels, step_ops

_OPS_CACHE: dict[str, list[Op]] = {}


def cached_step_ops(model: ModelConfig, micro_batch: int, seq_len: int, precision: str, checkpointing: str,
                    compiled: bool, optimizer: str, fixed: bool = False) -> list[Op]:
    """measure.record.step_ops of one micro-batch, memoised: a run asks for its plan several times. fixed:
    with each op's bytes that do not grow with the micro-batch, for pricing other sizes (scale_batch)."""
    key = repr((model, micro_batch, seq_len, precision, checkpointing, compiled, optimizer, fixed))
    if key not in _OPS_CACHE:
        _OPS_CACHE[key] = step_ops(model, micro_batch, seq_len, precision, checkpointing, 1, compiled, optimizer,
                                   fixed)
    return _OPS_CACHE[key]


def predict_step_time(model: ModelConfig, profile: Profile, *, micro_batch: int, seq_len: int, grad_accum: int,
                      compute_dtype: str, checkpointing: str, optimizer: str, zero: int, dp: int, n_params: int,
                      grad_bytes: int, param_bytes: int, compiled: bool = False, cuda: bool = False,
                      ops: list[Op] | None = None, record: str | None = None, reduces: int = 1) -> StepTime:
    """Predicted time of one optimizer step of `model` as the trainer runs it on the profiled device
    (cost.steptime.step_time), from its recorded operators (or `ops`: one micro-batch's, e.g. scaled by
    `plan --fit`); kernels this device's table lacks are timed first when the profile is this machine's.
    `record`: the precision the operators are recorded in (cost.recipe.Recipe.record_precision), by default
    the compute dtype's autocast; `reduces`: the gradient reduce-scatters per step (cost.comm.comm_seconds)."""
    precision = record or ("fp32" if compute_dtype == "fp32" else compute_dtype)
    if ops is None:
        ops = cached_step_ops(model, micro_batch, seq_len, precision, checkpointing, compiled and not cuda, optimizer)
    time_new_kernels(ops, profile)  # all of the step's new kernels together, in passes
    tensor_bytes = [4 * n for n in param_numels(model)]  # fp32 gradients, the weights' dtype, as grad_bytes counts
    return step_time(ops, profile, n_layers=model.n_layers, grad_tensor_bytes=tensor_bytes, n_params=n_params,
                     grad_accum=grad_accum, compute_dtype=compute_dtype, optimizer=optimizer, zero=zero, dp=dp,
                     grad_bytes=grad_bytes, param_bytes=param_bytes, compiled=compiled, cuda=cuda, reduces=reduces)
