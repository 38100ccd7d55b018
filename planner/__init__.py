"""Deployment planner: choose tensor/pipeline/replica sizes and predict memory and speed (no torch)."""

from shardserve.planner.errors import InfeasibleError, PlanError
from shardserve.planner.hardware import Hardware, parse_declared
from shardserve.planner.model_source import ModelInfo, load_model
from shardserve.planner.options import PlanOptions
from shardserve.planner.plan import Plan, make_plan

__all__ = ["Hardware", "InfeasibleError", "ModelInfo", "Plan", "PlanError", "PlanOptions",
           "load_model", "make_plan", "parse_declared"]
