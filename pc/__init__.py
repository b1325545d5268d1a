"""pc: predictive-coding networks whose settling (iterative inference) runs inside one jit.

networks (config, params, forward) -> energy (E, errors, dE/dx) -> settle (solvers) -> train (epochs).
"""

from pc.energy import energy, energy_and_grads, errors
from pc.generative import reconstruct, sample
from pc.networks import ACTIVATIONS, OUTPUTS, PCNet, forward, init_params, parse_arch
from pc.settle import (
    IMPLEMENTATIONS,
    SOLVERS,
    STABLE_STEP,
    SettleResult,
    curvature,
    settle,
    settle_activities,
    stable_dt,
)
from pc.train import VARIANTS, evaluate, label_targets, train_epoch

__all__ = [
    "ACTIVATIONS",
    "IMPLEMENTATIONS",
    "OUTPUTS",
    "PCNet",
    "SOLVERS",
    "STABLE_STEP",
    "SettleResult",
    "VARIANTS",
    "energy",
    "energy_and_grads",
    "curvature",
    "errors",
    "evaluate",
    "forward",
    "init_params",
    "label_targets",
    "parse_arch",
    "reconstruct",
    "sample",
    "settle",
    "settle_activities",
    "stable_dt",
    "train_epoch",
]
