"""Factories for planner tests: plans from catalog ids and declared hardware."""

from shardserve.planner import PlanOptions, load_model, make_plan, parse_declared


def plan_for(model: str, hardware: str, **options):
    return make_plan(load_model(model), parse_declared(hardware), PlanOptions(**options))
