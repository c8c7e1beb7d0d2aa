"""The analytic planner: parameters, FLOPs, memory and time of a training run, without tensors."""

from trainwise.cost.flops import flops_per_token_train, forward_flops_per_token, six_nd
from trainwise.cost.params import ParamCount, params
from trainwise.cost.plan import Plan, fit, plan_run

__all__ = ["ParamCount", "Plan", "fit", "flops_per_token_train", "forward_flops_per_token", "params",
           "plan_run", "six_nd"]
