"""Capacity planning: profile a worker's step times, simulate clusters on them, pick a P:D split.

    profile.py    `pd-serve profile`: prefill / decode / mixed step times from an EngineCore -> JSON
    costs.py      CostModel: interpolated step-time models fitted to a profile, transfer cost
    simulator.py  discrete-event simulation of xPyD or colocated workers under a workload
    plan.py       `pd-serve plan`: every split x a few batch limits, table and recommendation
"""
